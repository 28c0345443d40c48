"""What ``torch.cuda.memory_*`` report per emulated GPU, and out-of-memory errors: storages counted as blocks.

Every ``cuda`` tensor's data is a CPU storage. A storage is a block of its
GPU's caching allocator (``shim/memory/blocks.py``: segments, best-fit blocks,
splitting, per stream) from the first wrapper that holds it until the last one
is collected (views share their base's storage and are counted once; a view an
op makes keeps the wrapper it was made from alive instead of holding the
storage itself), allocated on the thread's current stream. An allocation the
allocator could not satisfy within the GPU's capacity (the profile's HBM,
``--hbm``, or ``set_per_process_memory_fraction``) raises
``torch.cuda.OutOfMemoryError`` with the allocator's own message.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
import warnings
from typing import Any

import torch

from shim.device import deferred
from shim.device import state  # noqa: F401 - it builds RUNTIME.device, which the allocator is sized by
from shim.memory import history as memory_history
from shim.memory.blocks import Block, DeviceMemory, allocation_size, parse_alloc_conf, round_size
from shim.device.storages import storage_key
from shim.rank.runtime import RUNTIME

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
#: where torch reads the allocator's settings, the first set one winning
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


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
    """Counts live storages per emulated GPU (keyed by the storage's base address) as allocator blocks."""

    def __init__(self, capacity: int, count: int):
        self._lock = threading.Lock()
        self.devices = [DeviceMemory(capacity, i) for i in range(count)]
        self._live: dict[int, Block] = {}  # a storage's base address -> its block (with its GPU and holders)
        #: the id of the calling thread's current stream on a GPU (shim/cuda/api.py installs it)
        self.stream_of = lambda gpu: 0
        self._configured = False  # PYTORCH_CUDA_ALLOC_CONF is read at the first allocation, as torch reads it
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
            return memory_history.snapshot(self.devices, self.history)

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
        if not self._configured:
            with self._lock:
                self._configure()
        d = self.devices[gpu]
        if not d.would_fit(nbytes, self.stream_of(gpu)):
            self._out_of_memory(d, gpu, nbytes)

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
            if not self._configured:
                self._configure()
            if self._freed:
                self._drain()  # first: a storage freed at this address must not be mistaken for this one
            block = self._live.get(key)
            if block is not None:
                block.holders += 1
                return key
            d = self.devices[gpu]
            nbytes = t.untyped_storage().nbytes()
            segments = d.num_device_alloc
            block = d.malloc(nbytes, self.stream_of(gpu))
            if block is None:  # an op's output that does not fit (raised, or kept for backward() to raise)
                self._out_of_memory(d, gpu, nbytes)
                block = d.malloc(nbytes, self.stream_of(gpu), force=True)
            block.gpu = gpu
            block.holders = 1
            self._live[key] = block
            if self.recorder is not None:
                for segment in d.released:
                    self.recorder.segment_free(gpu, segment)
                if d.num_device_alloc != segments:
                    head = d.segment_of(block)
                    self.recorder.segment_alloc(gpu, head, sum(b.size for b in d.segment_blocks(head)))
                self.recorder.alloc(gpu, block)
            if d.released:
                d.released = []
            self.version += 1
            return key

    def _configure(self) -> None:
        self._configured = True
        name = next((v for v in ALLOC_CONF_VARS if os.environ.get(v)), None)
        if name is None:
            return
        try:
            max_split, unmodeled = parse_alloc_conf(os.environ[name])
        except ValueError as e:
            raise RuntimeError(f"{name}: {e}") from None
        for d in self.devices:
            d.max_split_size = max_split
        if "expandable_segments" in unmodeled:
            unmodeled.remove("expandable_segments")
            # what a ROCm build says (c10/hip/HIPAllocatorConfig.h), then allocates as if it were off
            warnings.warn("expandable_segments not supported on this platform", UserWarning, stacklevel=2)
        if unmodeled:
            print(f"mirage: {name}: {', '.join(unmodeled)} not modeled: memory_reserved() and out-of-memory "
                  "follow the default caching allocator (memory_allocated() is unaffected)", file=sys.stderr,
                  flush=True)

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
            if entry is None or entry.holders != 1:
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
            block = self._live.get(key)
            if block is None:
                continue
            block.holders -= 1
            if block.holders == 0:
                del self._live[key]
                if self.recorder is not None:
                    self.recorder.free(block.gpu, block)
                self.devices[block.gpu].free(block)
                self.version += 1

    def empty_cache(self) -> None:
        """Give the segments that hold no allocation back to the GPU."""
        with self._lock:
            self._drain()
            for gpu, d in enumerate(self.devices):
                for segment in d.release_cached():
                    if self.recorder is not None:
                        self.recorder.segment_free(gpu, segment)
            self.version += 1

    def reset_peak(self, gpu: int) -> None:
        """``reset_peak_memory_stats``: peaks restart from the current figures."""
        with self._lock:
            self._drain()
            self.devices[gpu].reset_peak()

    def reset_accumulated(self, gpu: int) -> None:
        """``reset_accumulated_memory_stats``: the allocated/freed totals and the event counts restart."""
        with self._lock:
            self.devices[gpu].reset_accumulated()

    def mem_get_info(self, gpu: int) -> tuple[int, int]:
        """(free, total) bytes of ``gpu`` as this process sees it."""
        self.sync()
        d = self.devices[gpu]
        return d.capacity - d.reserved_total, d.capacity

    def _out_of_memory(self, d: DeviceMemory, gpu: int, nbytes: int) -> None:
        d.num_ooms += 1
        if self.recorder is not None:
            self.recorder.oom(gpu, round_size(nbytes), max(0, d.capacity - d.reserved_total))
        # c10 names the segment it failed to allocate (a 5 MiB request "tried to allocate 20.00 MiB")
        error = torch.cuda.OutOfMemoryError(self._oom_message(gpu, allocation_size(round_size(nbytes))))
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
            if not d.touched:
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
