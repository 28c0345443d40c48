"""A model of the HIP caching allocator, per emulated GPU: what ``torch.cuda.memory_*`` report, and OOM.

Every ``cuda`` tensor's data is a CPU storage. A storage is counted on its GPU
from the first wrapper that holds it until the last one is collected (views
share their base's storage and are counted once; a view an op makes keeps the
wrapper it was made from alive instead of holding the storage itself). Sizes
are rounded to the allocator's 512-byte blocks; reserved memory grows in 2 MiB
segments and only shrinks on ``empty_cache()``, as a caching allocator's does.
Allocations that would take a GPU past its capacity (the profile's HBM,
``--hbm``, or ``set_per_process_memory_fraction``) raise
``torch.cuda.OutOfMemoryError`` with the allocator's own message.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from typing import Any

import torch

from shim.device import deferred
from shim.device import state  # noqa: F401 - it builds RUNTIME.device, which the allocator is sized by
from shim.memory import history as memory_history
from shim.device.storages import storage_key
from shim.rank.runtime import RUNTIME

BLOCK = 512  # the allocator rounds every request up to this
SEGMENT = 2 << 20  # and reserves device memory in multiples of this
SMALL = 1 << 20  # requests up to this size come from the small pool
_POOLS = ("small_pool", "large_pool")


class DeviceMemory:
    """The counters of one emulated GPU's allocator, per pool (0: small, 1: large).

    Kept as plain integers updated in place: every tensor's birth and death
    passes through here, so this is on the hot path of every op.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.fraction = 1.0
        self.bytes = [0, 0]  # allocated now
        self.bytes_peak = [0, 0]
        self.bytes_in = [0, 0]  # ever allocated
        self.bytes_out = [0, 0]  # ever freed
        self.count = [0, 0]
        self.count_peak = [0, 0]
        self.count_in = [0, 0]
        self.count_out = [0, 0]
        self.reserved = [0, 0]
        self.reserved_peak = [0, 0]
        self.reserved_in = [0, 0]
        self.reserved_out = [0, 0]
        self.all_peak = 0  # the peak of the total is not the sum of the pools' peaks
        self.all_count_peak = 0
        self.reserved_all_peak = 0
        self.num_ooms = 0

    @property
    def allocated(self) -> int:
        return self.bytes[0] + self.bytes[1]

    @property
    def reserved_total(self) -> int:
        return self.reserved[0] + self.reserved[1]

    @property
    def limit(self) -> int:
        return int(self.capacity * self.fraction)

    def nested(self) -> dict:
        """The nested dict ``torch._C._cuda_memoryStats`` returns on a GPU build."""
        def stat(cur, peak, into, out, all_peak):
            table = {"all": {"current": sum(cur), "peak": all_peak, "allocated": sum(into), "freed": sum(out)}}
            for i, pool in enumerate(_POOLS):
                table[pool] = {"current": cur[i], "peak": peak[i], "allocated": into[i], "freed": out[i]}
            return table

        zero = stat([0, 0], [0, 0], [0, 0], [0, 0], 0)
        allocated = stat(self.bytes, self.bytes_peak, self.bytes_in, self.bytes_out, self.all_peak)
        count = stat(self.count, self.count_peak, self.count_in, self.count_out, self.all_count_peak)
        segments = [r // SEGMENT for r in self.reserved]
        return {
            "allocated_bytes": allocated,
            "active_bytes": allocated,  # nothing waits on a stream: active == allocated
            "requested_bytes": allocated,  # requests are counted at the allocator's 512-byte rounding
            "reserved_bytes": stat(self.reserved, self.reserved_peak, self.reserved_in, self.reserved_out,
                                   self.reserved_all_peak),
            "inactive_split_bytes": zero,
            "allocation": count,
            "active": count,
            "segment": stat(segments, [r // SEGMENT for r in self.reserved_peak],
                            [r // SEGMENT for r in self.reserved_in], [r // SEGMENT for r in self.reserved_out],
                            self.reserved_all_peak // SEGMENT),
            "inactive_split": zero,
            "oversize_allocations": zero["all"],
            "oversize_segments": zero["all"],
            "num_alloc_retries": 0,
            "num_ooms": self.num_ooms,
            "num_sync_all_streams": 0,
            "num_device_alloc": sum(self.reserved_in) // SEGMENT,
            "num_device_free": sum(self.reserved_out) // SEGMENT,
            "max_split_size": -1,
        }


_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


def _round(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _segments(n: int) -> int:
    return (n + SEGMENT - 1) // SEGMENT * SEGMENT


def format_size(n: int) -> str:
    """Sizes as c10's ``format_size`` prints them in allocator messages."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


class Allocator:
    """Counts live storages per emulated GPU (keyed by the storage's base address)."""

    def __init__(self, capacity: int, count: int):
        self._lock = threading.Lock()
        self.devices = [DeviceMemory(capacity) for _ in range(count)]
        self._live: dict[int, list] = {}  # base address -> [gpu, rounded size, pool, holders]
        # Frees come from finalisers, which the garbage collector may run inside hold() with the
        # lock taken: they only queue here (deque.append is atomic), and the queue is drained under it.
        self._freed: collections.deque[int] = collections.deque()
        self.version = 0  # bumped on every change, so a reporter knows when to speak
        # what _record_memory_history recorded (kept for snapshots once stopped), and it again while it records
        self.history: memory_history.History | None = None
        self.recorder: memory_history.History | None = None
        self.reporter = Reporter()
        #: pinned host tensors of shim.memory.pinned's fallback: id -> a weak reference to the tensor
        self.pinned: dict[int, Any] = {}

    def record_history(self, enabled, context="all", stacks="all", max_entries=sys.maxsize, clear_history=False,
                       *_rest) -> None:
        """``torch._C._cuda_record_memory_history``: start (``"state"``, ``"all"``) or stop (``None``) recording."""
        memory_history.check(enabled, context)
        with self._lock:
            self._drain()
            if enabled is None:  # stopped: what was recorded stays for a snapshot, unless cleared
                self.recorder = None
                if clear_history:
                    self.history = None
            elif self.history is None:
                self.history = self.recorder = memory_history.History(len(self.devices), enabled, context,
                                                                      max_entries)
            else:
                self.history.configure(enabled, context, max_entries, clear_history)
                self.recorder = self.history

    def snapshot(self, *_args) -> dict:
        """``torch._C._cuda_memorySnapshot``: every GPU's live blocks, and the trace recorded so far."""
        with self._lock:
            self._drain()
            return memory_history.snapshot(self._live, self.history, len(self.devices))

    def sync(self) -> None:
        """Apply the frees queued so far (before figures are read)."""
        with self._lock:
            self._drain()

    def stats(self, gpu: int) -> dict:
        """``gpu``'s figures in the nested shape of ``torch._C._cuda_memoryStats``."""
        self.sync()
        return self.devices[gpu].nested()

    def check(self, gpu: int, nbytes: int) -> None:
        """Raise OutOfMemoryError if ``nbytes`` more would not fit on ``gpu`` (before allocating)."""
        self.sync()
        d = self.devices[gpu]
        size = _round(nbytes)
        if d.allocated + size > d.limit:
            self._out_of_memory(d, gpu, size)

    def hold(self, t: torch.Tensor, gpu: int) -> int:
        """Count ``t``'s storage on ``gpu`` (once however many wrappers share it); return its key."""
        # Called for every op's output. Where the op came from C++ (the autograd engine's backward, DDP's
        # reducer) the cuda mode is on, and each tensor method below would pass through it: ~5 µs, not ~0.5
        with _NO_TORCH_FUNCTION():
            return self._hold(t, gpu)

    def _hold(self, t: torch.Tensor, gpu: int) -> int:
        ptr = t.data_ptr()
        offset = t.storage_offset() if ptr else 0
        key = ptr - offset * t.element_size() if offset else ptr
        if not key:
            # estimate mode: a meta storage has no address. (A meta view at an offset has a data_ptr(), the
            # offset's bytes past address 0, which would give every such view key 0: one entry, of the size
            # of the first storage seen there, that FSDP2's all-gather inputs on ranks other than 0 kept alive.)
            if t.is_meta and t.untyped_storage().nbytes():
                key = storage_key(t)
            else:
                return 0  # empty tensors own no memory
        with self._lock:
            if self._freed:
                self._drain()  # first: a storage freed at this address must not be mistaken for this one
            entry = self._live.get(key)
            if entry is not None:
                entry[3] += 1
                return key
            d = self.devices[gpu]
            size = _round(t.untyped_storage().nbytes())
            if d.bytes[0] + d.bytes[1] + size > d.limit:  # an op's output that does not fit
                self._out_of_memory(d, gpu, size)
            p = 0 if size <= SMALL else 1
            self._live[key] = [gpu, size, p, 1]
            if self.recorder is not None:
                self.recorder.alloc(gpu, key, size, t.untyped_storage().nbytes())
            d.bytes[p] += size
            d.bytes_in[p] += size
            d.count[p] += 1
            d.count_in[p] += 1
            if d.bytes[p] > d.bytes_peak[p]:
                d.bytes_peak[p] = d.bytes[p]
            if d.count[p] > d.count_peak[p]:
                d.count_peak[p] = d.count[p]
            total = d.bytes[0] + d.bytes[1]
            if total > d.all_peak:
                d.all_peak = total
                d.all_count_peak = max(d.all_count_peak, d.count[0] + d.count[1])
            if d.bytes[p] > d.reserved[p]:
                self._grow_reserved(d, p)
            self.version += 1
            return key

    def moved(self, t) -> None:
        """``t``'s storage was resized in place (FSDP2 frees and re-allocates this way): count it anew."""
        if t._mem:
            self.release(t._mem)
        t._mem = 0
        t._src = None  # a view counted through the wrapper it was made from now counts for itself
        t._mem = self.hold(t._elem, t._gpu)

    def rehome(self, t, move) -> bool:
        """Run ``move()``, which gives ``t``'s storage a new address and returns it, and count the storage there.

        ``shim.transport.shared_buffers`` moves a collective's storage into shared memory
        this way. Refused (False, ``move`` not run) unless ``t``'s wrapper (or
        the one it was viewed from) is the storage's only holder: any other
        would release it under the old address, which a new storage may take.
        """
        holder = t if t._mem or t._src is None else t._src
        with self._lock:
            self._drain()
            key = holder._mem
            entry = self._live.get(key) if key else None
            if entry is None or entry[3] != 1:
                return False
            new = move()
            if new != key and new not in self._live:
                del self._live[key]
                self._live[new] = entry
                holder._mem = new
            return True

    def release(self, key: int) -> None:
        """One wrapper of the storage at ``key`` is gone (safe to call from a finaliser)."""
        self._freed.append(key)

    def _drain(self) -> None:
        # with the lock held: the storage goes with its last wrapper
        while self._freed:
            key = self._freed.popleft()
            entry = self._live.get(key)
            if entry is None:
                continue
            entry[3] -= 1
            if entry[3] == 0:
                del self._live[key]
                gpu, size, p, _ = entry
                d = self.devices[gpu]
                d.bytes[p] -= size
                d.bytes_out[p] += size
                d.count[p] -= 1
                d.count_out[p] += 1
                self.version += 1
                if self.recorder is not None:
                    self.recorder.free(gpu, key, size)

    @staticmethod
    def _grow_reserved(d: DeviceMemory, p: int) -> None:
        # a caching allocator keeps what it reserved: reserved only grows, to cover what is allocated
        need = _segments(d.bytes[p]) - d.reserved[p]
        d.reserved[p] += need
        d.reserved_in[p] += need
        d.reserved_peak[p] = max(d.reserved_peak[p], d.reserved[p])
        d.reserved_all_peak = max(d.reserved_all_peak, d.reserved_total)

    def empty_cache(self) -> None:
        """Give back reserved segments that hold no allocation."""
        with self._lock:
            self._drain()
            for d in self.devices:
                for p in (0, 1):
                    spare = d.reserved[p] - _segments(d.bytes[p])
                    if spare > 0:
                        d.reserved[p] -= spare
                        d.reserved_out[p] += spare
            self.version += 1

    def reset_peak(self, gpu: int) -> None:
        """``reset_peak_memory_stats``: peaks restart from the current figures."""
        with self._lock:
            self._drain()
            d = self.devices[gpu]
            d.bytes_peak = list(d.bytes)
            d.count_peak = list(d.count)
            d.reserved_peak = list(d.reserved)
            d.all_peak = d.allocated
            d.all_count_peak = sum(d.count)
            d.reserved_all_peak = d.reserved_total

    def reset_accumulated(self, gpu: int) -> None:
        """``reset_accumulated_memory_stats``: the allocated/freed totals and the OOM count restart."""
        with self._lock:
            d = self.devices[gpu]
            for name in ("bytes_in", "bytes_out", "count_in", "count_out", "reserved_in", "reserved_out"):
                setattr(d, name, [0, 0])
            d.num_ooms = 0

    def mem_get_info(self, gpu: int) -> tuple[int, int]:
        """(free, total) bytes of ``gpu`` as this process sees it."""
        self.sync()
        d = self.devices[gpu]
        return d.capacity - d.reserved_total, d.capacity

    def _out_of_memory(self, d: DeviceMemory, gpu: int, size: int) -> None:
        d.num_ooms += 1
        if self.recorder is not None:
            self.recorder.oom(gpu, size, max(0, d.capacity - d.reserved_total))
        error = torch.cuda.OutOfMemoryError(self._oom_message(gpu, size))
        if not deferred.in_backward():
            raise error
        # raising on the autograd engine's thread aborts the process: backward() raises it instead,
        # and this allocation goes ahead (on the host) so the engine can finish the graph
        deferred.keep(error)

    def _oom_message(self, gpu: int, size: int) -> str:
        d = self.devices[gpu]
        allocated = d.allocated
        reserved = d.reserved_total
        free = max(0, d.capacity - reserved)
        limit = ""
        if d.fraction < 1.0:
            limit = f" {format_size(d.limit)} allowed;"
        return (
            f"CUDA out of memory. Tried to allocate {format_size(size)}. GPU {gpu} has a total capacity of "
            f"{format_size(d.capacity)} of which {format_size(free)} is free. Including non-PyTorch memory, "
            f"this process has {format_size(reserved)} memory in use.{limit} Of the allocated memory "
            f"{format_size(allocated)} is allocated by PyTorch, and {format_size(reserved - allocated)} is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


REPORT_INTERVAL_S = 0.25


class Reporter:
    """What the memory reporter of a rank knows: for whom it speaks, what it said last."""

    def __init__(self) -> None:
        self.speaks_as: tuple[int, int] | None = None  # (global rank, node); None until it starts
        self.lock = threading.Lock()  # the reporter's thread and the exit hook
        self.reported: tuple | None = None  # (allocator version, (rank, node)) as last reported
        self.pid = 0  # the process that started it: a forked child inherits the exit hook, not the rank


def start_reporter(rank: int, node: int) -> None:
    """Tell the daemon, a few times a second while it changes, what each GPU of this rank holds.

    Called again (a launcher's child learns its rank in ``init_process_group``),
    the running reporter speaks for the new rank from then on. The last figures
    go out at exit too.
    """
    reporter = RUNTIME.allocator.reporter
    started = reporter.speaks_as is not None
    reporter.speaks_as = (rank, node)
    if started:
        return
    reporter.pid = os.getpid()

    def run() -> None:
        while True:
            time.sleep(REPORT_INTERVAL_S)
            if not _report(timeout_s=5.0):
                return  # the daemon is gone: the run is ending, and the collectives will say so

    threading.Thread(target=run, name="mirage-memory-report", daemon=True).start()
    # a program that ends within a report interval of its last allocation still reports its peak
    atexit.register(_report, timeout_s=1.0)


def _report(timeout_s: float) -> bool:
    """Send every GPU's figures this rank touched, if they changed since the last report; False if the
    daemon could not be reached."""
    from wire.schema import MemoryReport

    allocator = RUNTIME.allocator
    reporter = allocator.reporter
    with reporter.lock:
        allocator.sync()
        now = (allocator.version, reporter.speaks_as)
        if now == reporter.reported or reporter.speaks_as is None or os.getpid() != reporter.pid:
            return True
        reporter.reported = now
        rank, node = reporter.speaks_as
        for i, d in enumerate(allocator.devices):
            if not d.bytes_in[0] + d.bytes_in[1]:
                continue  # a GPU this rank never touched
            report = MemoryReport(rank=rank, node=node, device=RUNTIME.device.physical[i], allocated=d.allocated,
                                  reserved=d.reserved_total, peak=d.all_peak, total=d.capacity)
            try:
                RUNTIME.client().request(report, timeout_s=timeout_s)
            except Exception:
                return False
    return True


def capacity(runtime) -> int:
    """Each GPU's memory: ``--hbm`` (``MIRAGE_HBM_BYTES``) if given, else the profile's."""
    override = runtime.settings.hbm_bytes
    return override if override else runtime.device.profile.hbm_bytes


def _build(runtime) -> None:
    runtime.allocator = Allocator(capacity(runtime), max(runtime.device.count, 1))


RUNTIME.attach(_build)
