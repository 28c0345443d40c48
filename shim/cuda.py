"""The ``torch.cuda`` / ``torch.accelerator`` surface of a ROCm build, answered from the profile.

A CPU build's ``torch.cuda`` functions raise "Torch not compiled with CUDA
enabled"; here they are replaced, in place on the real modules, so code that
imported ``torch.cuda`` before or after activation sees the same answers.
"""

from __future__ import annotations

import contextlib
import time
import uuid as uuid_mod
from dataclasses import dataclass

import torch

from shim import device as dev

HIP_VERSION = "6.4.43482-0f2d60242"
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
        total_memory=p.hbm_bytes,
        multi_processor_count=p.compute_units,
        warp_size=p.wavefront,
        L2_cache_size=p.l2_cache_bytes,
        uuid=str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"mirage/{p.name}/{node_gpu}")),
        pci_bus_id=node_gpu + 1,
        pci_device_id=0,
    )


def set_device(device) -> None:
    dev.STATE.current = _index(device)


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
    """Kernels run eagerly on the CPU, so every stream is always idle."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cuda", _index(device))
        self.priority = priority

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

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)


class Event:
    """Records wall time, so ``elapsed_time`` is real elapsed time between records."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
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


_default_streams: dict[int, Stream] = {}


def current_stream(device=None) -> Stream:
    i = _index(device)
    if i not in _default_streams:
        _default_streams[i] = Stream(i)
    return _default_streams[i]


def _seed_all(seed: int) -> None:
    # emulated kernels draw from the CPU generator, so that is the one to seed
    torch.default_generator.manual_seed(int(seed))


def install() -> None:
    """Replace the CPU build's ``torch.cuda`` answers with the emulated GPUs'."""
    c = torch.cuda
    count = dev.STATE.count
    replacements = {
        "is_available": lambda: count > 0,  # CUDA_VISIBLE_DEVICES="" hides every GPU
        "is_initialized": lambda: True,
        "init": lambda: None,
        "_lazy_init": lambda: None,
        "device_count": lambda: count,
        "current_device": lambda: dev.STATE.current,
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
        "default_stream": current_stream,
        "stream": lambda s=None: contextlib.nullcontext(s),
        "manual_seed": _seed_all,
        "manual_seed_all": _seed_all,
        "seed": lambda: torch.seed(),
        "seed_all": lambda: torch.seed(),
        "empty_cache": lambda: None,
    }
    for name, fn in replacements.items():
        setattr(c, name, fn)
    c.nccl.version = lambda: NCCL_VERSION
    torch.version.hip = HIP_VERSION
    torch.version.cuda = None

    acc = torch.accelerator
    for name, fn in {
        "is_available": lambda: count > 0,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: count,
        "current_device_index": lambda: dev.STATE.current,
        "set_device_index": set_device,
        "synchronize": lambda d=None: None,
    }.items():
        setattr(acc, name, fn)
