"""The ``torch.cuda`` / ``torch.accelerator`` surface of a ROCm build, answered from the profile.

A CPU build's ``torch.cuda`` functions raise "Torch not compiled with CUDA
enabled"; here they are replaced, in place on the real modules, so code that
imported ``torch.cuda`` before or after activation sees the same answers.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid as uuid_mod
from dataclasses import dataclass

import torch

from shim import device as dev
from shim import rng
from shim.memory import ALLOCATOR

HIP_VERSION = "6.4.43482-0f2d60242"
#: MIOpen 3.4 (ROCm 6.4), which ROCm builds report as torch.backends.cudnn.version().
MIOPEN_VERSION = 3004000
#: The RCCL release the emulated collectives answer as (torch.cuda.nccl.version()).
NCCL_VERSION = (2, 22, 3)


def _index(d=None) -> int:
    """Normalise the many ways torch names a device to an emulated ordinal."""
    if d is None:
        return dev.STATE.current
    if isinstance(d, str):
        d = torch.device(d)
    if isinstance(d, torch.device):
        if d.type not in ("cuda", "mirage"):
            raise ValueError(f"Expected a cuda device, but got: {d}")
        return dev.STATE.current if d.index is None else dev.check_index(d.index)
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
    node_gpu = dev.STATE.physical[i]  # identity follows the GPU, not the visible ordinal
    p = dev.STATE.profile
    return DeviceProperties(
        name=p.product,
        major=p.major,
        minor=p.minor,
        gcnArchName=p.gcn_arch_name,
        total_memory=ALLOCATOR.devices[i].capacity,
        multi_processor_count=p.compute_units,
        warp_size=p.wavefront,
        L2_cache_size=p.l2_cache_bytes,
        uuid=str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"mirage/{p.name}/{node_gpu}")),
        pci_bus_id=node_gpu + 1,
        pci_device_id=0,
    )


def set_device(device) -> None:
    dev.STATE.current = _index(device)
    dev.initialize()


def current_device() -> int:
    dev.initialize()
    return dev.STATE.current


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
        self.prev_idx = dev.STATE.current
        if self.idx >= 0:
            dev.STATE.current = self.idx

    def __exit__(self, *exc):
        dev.STATE.current = self.prev_idx
        return False


class Stream:
    """A stream of emulated GPU ``device``. Kernels run eagerly on the CPU, so every stream is always idle.

    Streams are still distinct objects with their own ids and priorities, and
    each thread has a current stream per device, so code that compares,
    switches or synchronises streams (FSDP2's all-gather and reduce-scatter
    streams, for instance) behaves as on a GPU.
    """

    _ids = itertools.count(1)

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cuda", _index(device))
        self.device_index = self.device.index
        self.device_type = "cuda"
        self.priority = max(-1, min(0, int(priority)))  # ROCm's range is (0, -1), as CUDA's
        self.stream_id = next(Stream._ids)
        self.cuda_stream = 0x1000 * self.stream_id  # an opaque handle, unique per stream

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -1

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False  # no CUDA/HIP graphs here

    def __enter__(self):
        self._context = stream(self)
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x}>"


class _DefaultStream(Stream):
    """The null stream of a device (``cuda_stream`` 0), what ``default_stream`` returns."""

    def __init__(self, device):
        super().__init__(device)
        self.stream_id = 0
        self.cuda_stream = 0


class Event:
    """Records wall time, so ``elapsed_time`` is real elapsed time between records."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._t: float | None = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._t - self._t) * 1000.0

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {id(self):#x}>"


_default_streams: dict[int, Stream] = {}
_current = threading.local()  # as in CUDA, the current stream is per thread (and per device)


def default_stream(device=None) -> Stream:
    i = _index(device)
    if i not in _default_streams:
        _default_streams[i] = _DefaultStream(i)
    return _default_streams[i]


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
    _current.streams[s.device.index] = s


class stream(contextlib.AbstractContextManager):  # noqa: N801 - torch's name
    """``with torch.cuda.stream(s):`` makes ``s`` current (and its device) for the block."""

    def __init__(self, s: Stream | None):
        self.stream = s
        self._prev: tuple[Stream, int] | None = None

    def __enter__(self):
        if self.stream is not None:
            self._prev = (current_stream(self.stream.device), dev.STATE.current)
            dev.STATE.current = self.stream.device.index
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self._prev is not None:
            set_stream(self._prev[0])
            dev.STATE.current = self._prev[1]
        return False


def _set_fraction(fraction: float, device: int) -> None:
    ALLOCATOR.devices[_index(device)].fraction = fraction


def _install_memory() -> None:
    """Answer torch.cuda.memory_* (and torch.accelerator's) from the allocator model.

    torch's own functions stay (memory_summary formats what memory_stats returns);
    only the C entry points a CPU build lacks are provided.
    """
    C = torch._C
    stats = lambda d=None: ALLOCATOR.stats(_index(d))  # noqa: E731
    entry_points = {
        "_cuda_memoryStats": stats,
        "_cuda_resetPeakMemoryStats": lambda d=None: ALLOCATOR.reset_peak(_index(d)),
        "_cuda_resetAccumulatedMemoryStats": lambda d=None: ALLOCATOR.reset_accumulated(_index(d)),
        "_cuda_emptyCache": ALLOCATOR.empty_cache,
        "_cuda_setMemoryFraction": _set_fraction,
        "_cuda_getMemoryFraction": lambda d=None: ALLOCATOR.devices[_index(d)].fraction,
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_getDeviceStats": stats,
        "_accelerator_resetPeakStats": lambda d=None: ALLOCATOR.reset_peak(_index(d)),
        "_accelerator_resetAccumulatedStats": lambda d=None: ALLOCATOR.reset_accumulated(_index(d)),
        "_accelerator_emptyCache": ALLOCATOR.empty_cache,
        "_accelerator_getMemoryInfo": lambda d=None: ALLOCATOR.mem_get_info(_index(d)),
    }
    for name, fn in entry_points.items():
        setattr(C, name, fn)
    m = torch.cuda.memory
    m.is_initialized = lambda: True  # its own binding of torch.cuda.is_initialized
    m._lazy_init = lambda: None
    mem_get_info = lambda d=None: ALLOCATOR.mem_get_info(_index(d))  # noqa: E731
    m.mem_get_info = torch.cuda.mem_get_info = mem_get_info


def install() -> None:
    """Replace the CPU build's ``torch.cuda`` answers with the emulated GPUs'."""
    c = torch.cuda
    count = dev.STATE.count
    replacements = {
        "is_available": lambda: count > 0,  # CUDA_VISIBLE_DEVICES="" hides every GPU
        "is_initialized": lambda: dev.STATE.initialized,
        "init": dev.initialize,
        "_lazy_init": dev.initialize,
        "device_count": lambda: count,
        "current_device": current_device,
        "set_device": set_device,
        "device": device,
        "get_device_name": lambda d=None: get_device_properties(d).name,
        "get_device_capability": lambda d=None: (get_device_properties(d).major, get_device_properties(d).minor),
        "get_device_properties": get_device_properties,
        "get_arch_list": lambda: [dev.STATE.profile.gfx],
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": lambda d=None: None,
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "StreamContext": stream,
        "is_current_stream_capturing": lambda: False,
    }
    for name, fn in replacements.items():
        setattr(c, name, fn)
    dev.ON_INITIALIZE.append(_run_queued_calls)
    _install_memory()
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
        "current_device_index": lambda: dev.STATE.current,
        "set_device_index": set_device,
        "synchronize": lambda d=None: None,
        "current_stream": current_stream,
        "set_stream": set_stream,
        "device_index": device,
    }.items():
        setattr(acc, name, fn)
    # the C entry point Python callers (FSDP2's default mesh, DTensor) read the accelerator from
    torch._C._get_accelerator = lambda check=False: torch.device("cuda")
