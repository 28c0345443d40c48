"""The ``torch.cuda`` / ``torch.accelerator`` surface of a ROCm build, answered from the profile.

A CPU build's ``torch.cuda`` functions raise "Torch not compiled with CUDA
enabled"; here they are replaced, in place on the real modules, so code that
imported ``torch.cuda`` before or after activation sees the same answers.

Up to 700 lines on purpose: it is the one map of the surface :func:`install`
patches (devices, streams, events, memory queries, the smi, roctx ranges), each
entry a small adapter to the profile or the clock; the heavier parts already live
elsewhere (:mod:`shim.memory.allocator`, :mod:`shim.clock.clock`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import uuid as uuid_mod
from dataclasses import dataclass

import torch

from shim.cuda import graphs, tunable
from shim.device import rng
from shim.device import state as dev
from shim.memory import allocator  # noqa: F401 - it builds RUNTIME.allocator
from shim.memory.history import stream_handle
from shim.rank.runtime import RUNTIME

HIP_VERSION = "6.4.43482-0f2d60242"
#: MIOpen 3.4 (ROCm 6.4), which ROCm builds report as torch.backends.cudnn.version().
MIOPEN_VERSION = 3004000
#: The RCCL release the emulated collectives answer as (torch.cuda.nccl.version()).
NCCL_VERSION = (2, 22, 3)


def _index(d=None) -> int:
    """Normalise the many ways torch names a device to an emulated ordinal."""
    if d is None:
        return RUNTIME.device.current
    if isinstance(d, str):
        d = torch.device(d)
    if isinstance(d, torch.device):
        if d.type not in ("cuda", "mirage"):
            raise ValueError(f"Expected a cuda device, but got: {d}")
        return RUNTIME.device.current if d.index is None else dev.check_index(d.index)
    return dev.check_index(int(d))


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns on ROCm (same field names)."""

    name: str
    major: int
    minor: int
    gcnArchName: str  # noqa: N815 - torch's spelling
    total_memory: int
    multi_processor_count: int
    warp_size: int
    L2_cache_size: int  # noqa: N815
    uuid: str
    pci_bus_id: int
    pci_device_id: int
    pci_domain_id: int = 0
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 131072
    shared_memory_per_block: int = 65536

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"gcnArchName='{self.gcnArchName}', total_memory={self.total_memory // 2**20}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
            f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self.L2_cache_size // 2**20}MB)"
        )


def get_device_properties(device=None) -> DeviceProperties:
    i = _index(device)
    node_gpu = RUNTIME.device.physical[i]  # identity follows the GPU, not the visible ordinal
    p = RUNTIME.device.profile
    return DeviceProperties(
        name=p.product,
        major=p.major,
        minor=p.minor,
        gcnArchName=p.gcn_arch_name,
        total_memory=RUNTIME.allocator.devices[i].capacity,
        multi_processor_count=p.compute_units,
        warp_size=p.wavefront,
        L2_cache_size=p.l2_cache_bytes,
        uuid=str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"mirage/{p.name}/{node_gpu}")),
        pci_bus_id=node_gpu + 1,
        pci_device_id=0,
    )


def set_device(device) -> None:
    RUNTIME.device.current = _index(device)
    dev.initialize()


def current_device() -> int:
    dev.initialize()
    return RUNTIME.device.current


def _run_queued_calls() -> None:
    # what torch.cuda._lazy_init does once the runtime is up: calls queued before it (seeds, checks)
    c = torch.cuda
    c._queued_calls.extend(calls for calls in c._lazy_seed_tracker.get_calls() if calls)
    calls, c._queued_calls[:] = list(c._queued_calls), []
    for queued_call, _ in calls:
        queued_call()


class device:  # noqa: N801 - torch's name
    """``with torch.cuda.device(i):`` switches the current device for the block."""

    def __init__(self, device):
        self.idx = -1 if device is None else _index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = RUNTIME.device.current
        if self.idx >= 0:
            RUNTIME.device.current = self.idx

    def __exit__(self, *exc):
        RUNTIME.device.current = self.prev_idx
        return False


#: what torch's C++ stream and event objects of an emulated GPU say they are on (one backend device)
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
#: the device type number a GPU build's cuda streams report (c10::DeviceType::CUDA)
_CUDA_TYPE = int(torch._C._autograd.DeviceType.CUDA)


class Stream(torch._C.Stream):
    """A stream of emulated GPU ``device``. Kernels run eagerly on the CPU, so every stream is always idle.

    Streams are still distinct objects with their own ids and priorities, and
    each thread has a current stream per device, so code that compares,
    switches or synchronises streams (FSDP2's all-gather and reduce-scatter
    streams, for instance) behaves as on a GPU. Like a GPU build's
    ``torch.cuda.Stream`` it is a ``torch.Stream``; the C++ object underneath
    sits on the one backend device, so the device, the comparisons and the
    methods are answered here.
    """

    _ids = itertools.count(1)

    def __new__(cls, device=None, priority=0, **kwargs):
        return cls._make(_index(device), next(Stream._ids), priority)

    @classmethod
    def _make(cls, gpu: int, stream_id: int, priority: int) -> Stream:
        s = super().__new__(cls, stream_id=stream_id, device_index=0, device_type=_PRIVATEUSE1)
        s._gpu = gpu
        s.priority = max(-1, min(0, int(priority)))  # ROCm's range is (0, -1), as CUDA's
        s.cuda_stream = stream_handle(stream_id)  # an opaque handle, unique per stream (0: the null stream)
        s._contexts = []
        return s

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._gpu)

    @property
    def device_index(self) -> int:  # type: ignore[override]
        return self._gpu

    @property
    def device_type(self) -> int:  # type: ignore[override]
        return _CUDA_TYPE

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -1

    def wait_stream(self, stream) -> None:
        clock = RUNTIME.clock
        if clock is not None:  # clocked mode: later kernels here start after that stream's
            clock.stream_wait(self._gpu, self.stream_id, clock.stream_time(stream._gpu, stream.stream_id))

    def wait_event(self, event) -> None:
        if RUNTIME.clock is not None and event._emu is not None:
            RUNTIME.clock.stream_wait(self._gpu, self.stream_id, event._emu)

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if RUNTIME.device.sync_debug:  # a stream's synchronize is one set_sync_debug_mode flags
            dev.synchronizing()
        if RUNTIME.clock is not None:
            RUNTIME.clock.host_wait(RUNTIME.clock.stream_time(self._gpu, self.stream_id))

    def is_capturing(self) -> bool:
        return graphs.capturing()  # a capture is the capturing thread's (shim/cuda/graphs.py)

    def native_handle(self) -> int:
        return self.cuda_stream

    def __eq__(self, other) -> bool:
        # the C++ comparison would see every GPU's null stream as the same (one backend device)
        return isinstance(other, Stream) and (self.stream_id, self._gpu) == (other.stream_id, other._gpu)

    def __ne__(self, other) -> bool:
        return not self == other  # not inherited from __eq__: the C++ class compares both ways itself

    def __hash__(self) -> int:
        return hash((self.stream_id, self._gpu))

    def __enter__(self):
        context = stream(self)
        self._contexts.append(context)
        return context.__enter__()

    def __exit__(self, *exc):
        return self._contexts.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x}>"


def _default_stream_of(gpu: int) -> Stream:
    """The null stream of a device (``stream_id`` and ``cuda_stream`` 0), what ``default_stream`` returns."""
    return Stream._make(gpu, 0, 0)


class Event(torch._C.Event):
    """Records wall time, so ``elapsed_time`` is real elapsed time between records; in clocked mode
    it records emulated time instead (when its stream gets there), as a GPU's event does.

    A ``torch.Event``, as a GPU build's ``torch.cuda.Event`` is; every method
    is answered here (kernels have finished when ``record`` returns).
    """

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False, external=False, *, device=None):
        e = super().__new__(cls, device=dev.BACKEND, enable_timing=enable_timing, blocking=blocking,
                            interprocess=interprocess)
        e.enable_timing = enable_timing
        e.blocking = blocking
        e.interprocess = interprocess
        e._gpu = None if device is None else _index(device)  # set by record(), as on a GPU
        e._t = None
        e._emu = None  # clocked mode: the emulated time it fires at
        return e

    @property
    def device(self) -> torch.device | None:  # type: ignore[override]
        return None if self._gpu is None else torch.device("cuda", self._gpu)

    def record(self, stream=None) -> None:  # type: ignore[override]
        stream = stream or current_stream(self._gpu)
        self._gpu = stream.device_index
        self._t = time.perf_counter()
        if RUNTIME.clock is not None:
            self._emu = RUNTIME.clock.stream_time(stream._gpu, stream.stream_id)

    def wait(self, stream=None) -> None:  # type: ignore[override]
        if RUNTIME.clock is not None:
            (stream or current_stream(self._gpu)).wait_event(self)

    def query(self) -> bool:  # type: ignore[override]
        return True

    def synchronize(self) -> None:  # type: ignore[override]
        if RUNTIME.clock is not None and self._emu is not None:
            RUNTIME.clock.host_wait(self._emu)

    def elapsed_time(self, end_event) -> float:  # type: ignore[override]
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if RUNTIME.clock is not None:
            return (end_event._emu - self._emu) * 1000.0
        return (end_event._t - self._t) * 1000.0

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {id(self):#x}>"


class _AnyOf(type):
    """Metaclass of the generic classes: ``isinstance`` accepts every object of the C++ class they stand for."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.__mro__[1])

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.__mro__[1])


def _accelerator_device(device) -> torch.device:
    """The device a generic stream or event is for: ``None`` means the accelerator, which is ``cuda``."""
    if device is None:
        return torch.device("cuda")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


class GenericStream(torch._C.Stream, metaclass=_AnyOf):
    """``torch.Stream``: on ``cuda`` (the accelerator, the default) a :class:`Stream` of the emulated GPU."""

    def __new__(cls, *args, **kwargs):
        if len(args) > 1 or "stream_id" in kwargs:  # (stream_id, device_index, device_type): a handle torch made
            return torch._C.Stream(*args, **kwargs)
        d = _accelerator_device(args[0] if args else kwargs.get("device"))
        priority = kwargs.get("priority", 0)
        if d.type in ("cuda", dev.BACKEND):
            return Stream(d if d.type == "cuda" else None, priority=priority)
        return torch._C.Stream(device=d, priority=priority)


class GenericEvent(torch._C.Event, metaclass=_AnyOf):
    """``torch.Event``: on ``cuda`` (the accelerator, the default) an :class:`Event` of the emulated GPU."""

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        d = _accelerator_device(device)
        if d.type in ("cuda", dev.BACKEND):
            return Event(enable_timing, blocking, interprocess, device=d if d.type == "cuda" else None)
        return torch._C.Event(device=d, enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


_current = threading.local()  # as in CUDA, the current stream is per thread (and per device)


def default_stream(device=None) -> Stream:
    i = _index(device)
    streams = RUNTIME.cuda.default_streams
    if i not in streams:
        streams[i] = _default_stream_of(i)
    return streams[i]


def current_stream(device=None) -> Stream:
    i = _index(device)
    current = getattr(_current, "streams", {})
    return current.get(i) or default_stream(i)


def set_stream(s: Stream | None) -> None:
    """Make ``s`` the current stream of its device (for this thread)."""
    if s is None:
        return
    if not hasattr(_current, "streams"):
        _current.streams = {}
    _current.streams[s.device_index] = s


class stream(contextlib.AbstractContextManager):  # noqa: N801 - torch's name
    """``with torch.cuda.stream(s):`` makes ``s`` current (and its device) for the block."""

    def __init__(self, s: Stream | None):
        self.stream = s
        self._prev: tuple[Stream, int] | None = None

    def __enter__(self):
        if self.stream is not None:
            self._prev = (current_stream(self.stream.device_index), RUNTIME.device.current)
            RUNTIME.device.current = self.stream.device_index
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self._prev is not None:
            set_stream(self._prev[0])
            RUNTIME.device.current = self._prev[1]
        return False


def synchronize(device=None) -> None:
    """Wait for the device's kernels: they ran eagerly, so only the device is checked, as the runtime does
    (in clocked mode the host's clock also waits for the device's streams)."""
    i = _index(device)
    if RUNTIME.clock is not None:
        RUNTIME.clock.host_wait(RUNTIME.clock.device_time(i))


class _Smi:
    """What amd-smi reports for the emulated GPUs (``torch.cuda.utilization``, ``temperature``, ...).

    A GPU is busy while its process computes, so utilization is the share of
    wall time this process spent on a CPU over the last sample period (at least
    1/6 s, as the SMI's are; at most 100 %), on the GPUs it holds memory on, and
    0 on the others. Temperature, power and clock follow utilization linearly
    between an idle and a full-load figure; memory used is what the caching
    allocator model has reserved.
    """

    SAMPLE_S = 1 / 6
    IDLE_C, BUSY_C = 40, 85  # junction temperature, degrees C
    IDLE_POWER = 0.15  # of the profile's board power
    IDLE_CLOCK = 0.25  # of the profile's peak engine clock

    def __init__(self):
        self._lock = threading.Lock()
        self._at = (time.monotonic(), time.process_time())
        self._busy = 0.0

    def busy(self) -> float:
        """This process's share of wall time on a CPU (0..1) over the last sample period."""
        with self._lock:
            wall, cpu = time.monotonic(), time.process_time()
            elapsed = wall - self._at[0]
            if elapsed >= self.SAMPLE_S:
                self._busy = min(1.0, max(0.0, (cpu - self._at[1]) / elapsed))
                self._at = (wall, cpu)
            return self._busy

    def utilization(self, device=None) -> int:
        i = _index(device)
        RUNTIME.allocator.sync()
        return round(100 * self.busy()) if RUNTIME.allocator.devices[i].reserved_total else 0

    def temperature(self, device=None) -> int:
        return round(self.IDLE_C + (self.BUSY_C - self.IDLE_C) * self.utilization(device) / 100)

    def power_draw(self, device=None) -> int:
        """Socket power in W: the ROCm path reports amd-smi's ``average_socket_power``, which is in watts."""
        board = RUNTIME.device.profile.board_power_w
        return round(board * (self.IDLE_POWER + (1 - self.IDLE_POWER) * self.utilization(device) / 100))

    def clock_rate(self, device=None) -> int:
        """The graphics (engine) clock in MHz."""
        peak = RUNTIME.device.profile.clock_mhz
        return round(peak * (self.IDLE_CLOCK + (1 - self.IDLE_CLOCK) * self.utilization(device) / 100))

    def device_memory_used(self, device=None) -> int:
        """Bytes in use on the GPU; amd-smi counts whole MiB (``vram_used``)."""
        i = _index(device)
        RUNTIME.allocator.sync()
        return RUNTIME.allocator.devices[i].reserved_total >> 20 << 20

    def list_gpu_processes(self, device=None) -> str:
        """torch's text for amd-smi's process list: this process, if it holds memory on the GPU."""
        i = _index(device)
        used = self.device_memory_used(i)
        lines = [f"GPU:{i}"]
        if used:
            lines.append(f"process {os.getpid():>10d} uses {used / 2**20:>12.3f} MB GPU memory")
        else:
            lines.append("no processes are running")
        return "\n".join(lines)


class CudaState:
    """The rank's ``torch.cuda`` surface (``RUNTIME.cuda``): each GPU's default stream as made, the SMI's
    sampling, the mode ``shim.cuda.mode`` pushed, and the next graph pool's id."""

    def __init__(self) -> None:
        self.default_streams: dict[int, Stream] = {}
        self.smi = _Smi()
        self.mode = None  # shim.cuda.mode.CudaMode, once installed
        self.graph_pools = itertools.count(1)  # the ids of CUDA graphs' memory pools (shim.cuda.graphs)


def _build(runtime) -> None:
    runtime.cuda = CudaState()


RUNTIME.attach(_build)


def _set_fraction(fraction: float, device: int) -> None:
    RUNTIME.allocator.devices[_index(device)].fraction = fraction


def _set_sync_debug_mode(mode: int) -> None:
    """``torch.cuda.set_sync_debug_mode``: 0, or warn (1) / raise (2) where an op waits for the GPU
    (``shim/tensor/wrapper.py``'s ``_synchronizes``, ``.tolist()``, ``Stream.synchronize()``)."""
    if mode not in (0, 1, 2):
        raise RuntimeError("invalid value of debug_mode, expected one of 0, 1, 2")
    RUNTIME.device.sync_debug = mode


def _record_history_legacy(enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1,
                           trace_alloc_record_context: bool = False, record_context_cpp: bool = False,
                           clear_history: bool = False, *_rest) -> None:
    """``_record_memory_history(True, ...)``, torch's older form: stacks if ``record_context``, a trace of
    ``trace_alloc_max_entries`` entries if more than 1."""
    if not enabled:
        RUNTIME.allocator.record_history(None, clear_history=clear_history)
    else:
        RUNTIME.allocator.record_history("all" if trace_alloc_max_entries > 1 else "state",
                                 "all" if record_context else None, "python", max(trace_alloc_max_entries, 1),
                                 clear_history)


def _install_memory() -> None:
    """Answer torch.cuda.memory_* (and torch.accelerator's) from the allocator model.

    torch's own functions stay (memory_summary formats what memory_stats returns);
    only the C entry points a CPU build lacks are provided.
    """
    C = torch._C
    stats = lambda d=None: RUNTIME.allocator.stats(_index(d))  # noqa: E731
    entry_points = {
        "_cuda_memoryStats": stats,
        "_cuda_resetPeakMemoryStats": lambda d=None: RUNTIME.allocator.reset_peak(_index(d)),
        "_cuda_resetAccumulatedMemoryStats": lambda d=None: RUNTIME.allocator.reset_accumulated(_index(d)),
        "_cuda_emptyCache": RUNTIME.allocator.empty_cache,
        "_cuda_setMemoryFraction": _set_fraction,
        "_cuda_getMemoryFraction": lambda d=None: RUNTIME.allocator.devices[_index(d)].fraction,
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_getDeviceStats": stats,
        "_accelerator_resetPeakStats": lambda d=None: RUNTIME.allocator.reset_peak(_index(d)),
        "_accelerator_resetAccumulatedStats": lambda d=None: RUNTIME.allocator.reset_accumulated(_index(d)),
        "_accelerator_emptyCache": RUNTIME.allocator.empty_cache,
        "_accelerator_getMemoryInfo": lambda d=None: RUNTIME.allocator.mem_get_info(_index(d)),
        "_cuda_getAllocatorBackend": lambda: "native",  # PYTORCH_CUDA_ALLOC_CONF's default backend
        "_cuda_ipc_collect": lambda: None,  # no CUDA IPC handles: nothing to release
        "_cuda_set_sync_debug_mode": _set_sync_debug_mode,
        "_cuda_get_sync_debug_mode": lambda: RUNTIME.device.sync_debug,
        # the memory history and snapshots (shim/memory/history.py)
        "_cuda_record_memory_history": RUNTIME.allocator.record_history,
        "_cuda_record_memory_history_legacy": _record_history_legacy,
        "_cuda_memorySnapshot": RUNTIME.allocator.snapshot,
    }
    for name, fn in entry_points.items():
        setattr(C, name, fn)
    m = torch.cuda.memory
    m.is_initialized = lambda: True  # its own binding of torch.cuda.is_initialized
    m._lazy_init = lambda: None
    mem_get_info = lambda d=None: RUNTIME.allocator.mem_get_info(_index(d))  # noqa: E731
    m.mem_get_info = torch.cuda.mem_get_info = mem_get_info
    m.list_gpu_processes = RUNTIME.cuda.smi.list_gpu_processes


class _Roctx(threading.local):
    """``torch.cuda.nvtx``'s library as on a ROCm build (roctx): ranges go to a tracer, none listens here.

    DeepSpeed's accelerator pushes and pops a range around every step; the CPU
    build's stub raises "NVTX functions not installed". Depths and range ids
    are returned as roctx returns them.
    """

    depth = 0
    next_id = 0

    def rangePushA(self, msg: str) -> int:  # noqa: N802 - torch's names
        self.depth += 1
        return self.depth - 1

    def rangePop(self) -> int:  # noqa: N802
        if self.depth == 0:
            return -1  # roctx's answer for a pop with nothing pushed
        self.depth -= 1
        return self.depth

    def markA(self, msg: str) -> None:  # noqa: N802
        pass

    def rangeStartA(self, msg: str) -> int:  # noqa: N802
        self.next_id += 1
        return self.next_id

    def rangeEnd(self, range_id: int) -> None:  # noqa: N802
        pass

    def deviceRangeStart(self, msg: str, stream: int = 0) -> int:  # noqa: N802
        return self.rangeStartA(msg)

    def deviceRangeEnd(self, range_handle, stream: int = 0) -> None:  # noqa: N802
        pass


def _current_stream_id(gpu: int) -> int:
    """The id of the thread's current stream on ``gpu`` (clocked mode asks for each kernel, the allocator for
    each block)."""
    current = getattr(_current, "streams", None)
    s = current.get(gpu) if current else None
    return 0 if s is None else s.stream_id


def install() -> None:
    """Replace the CPU build's ``torch.cuda`` answers with the emulated GPUs'."""
    import torch.cuda.nvtx

    if RUNTIME.clock is not None:
        RUNTIME.clock.stream_of = _current_stream_id
    RUNTIME.allocator.stream_of = _current_stream_id  # memory freed on one stream is reused on that stream

    torch.cuda.nvtx._nvtx = _Roctx()
    c = torch.cuda
    count = RUNTIME.device.count
    smi = RUNTIME.cuda.smi
    replacements = {
        "is_available": lambda: count > 0,  # CUDA_VISIBLE_DEVICES="" hides every GPU
        "is_initialized": lambda: RUNTIME.device.initialized,
        "init": dev.initialize,
        "_lazy_init": dev.initialize,
        "device_count": lambda: count,
        "current_device": current_device,
        "set_device": set_device,
        "device": device,
        "get_device_name": lambda d=None: get_device_properties(d).name,
        "get_device_capability": lambda d=None: (get_device_properties(d).major, get_device_properties(d).minor),
        "get_device_properties": get_device_properties,
        "get_arch_list": lambda: [RUNTIME.device.profile.gfx],
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": synchronize,
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "StreamContext": stream,
        # amd-smi's figures (a CPU build has no amdsmi to ask)
        "utilization": smi.utilization,
        "memory_usage": smi.utilization,  # memory activity: the same busy share
        "temperature": smi.temperature,
        "power_draw": smi.power_draw,
        "clock_rate": smi.clock_rate,
        "device_memory_used": smi.device_memory_used,
        "list_gpu_processes": smi.list_gpu_processes,
    }
    for name, fn in replacements.items():
        setattr(c, name, fn)
    RUNTIME.device.on_initialize.append(_run_queued_calls)
    _install_memory()
    graphs.install()  # CUDA graphs: capture records the ops, replay runs them again (shim/cuda/graphs.py)
    tunable.install()  # TunableOp's settings, nothing tuned (shim/cuda/tunable.py)
    rng.install()
    _record_stream = torch.Tensor.record_stream

    def record_stream(self, stream):
        # torch's parser wants a C++ stream; ours are Python, and kernels run eagerly, so nothing waits
        if not isinstance(stream, Stream):
            return _record_stream(self, stream)

    torch.Tensor.record_stream = record_stream
    c.nccl.version = lambda: NCCL_VERSION
    torch.version.hip = HIP_VERSION
    torch.version.cuda = None
    # a ROCm build is a "CUDA" build whose cuDNN is MIOpen
    torch.backends.cuda.is_built = lambda: True
    torch.backends.cudnn.is_available = lambda: True
    torch.backends.cudnn.version = lambda: MIOPEN_VERSION

    acc = torch.accelerator
    for name, fn in {
        "is_available": lambda: count > 0,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: count,
        "current_device_index": lambda: RUNTIME.device.current,
        "set_device_index": set_device,
        # functions of their own, not torch.cuda's: dynamo keys its handlers by function and registers both
        "synchronize": lambda device=None: synchronize(device),
        "current_stream": lambda device=None: current_stream(device),
        "set_stream": lambda stream: set_stream(stream),
        "device_index": device,
    }.items():
        setattr(acc, name, fn)
    # the generic classes, whose device defaults to the accelerator's, make the same streams and events
    torch.Stream = GenericStream
    torch.Event = GenericEvent
    # the C entry point Python callers (FSDP2's default mesh, DTensor) read the accelerator from
    torch._C._get_accelerator = lambda check=False: torch.device("cuda")
