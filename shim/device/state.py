"""The emulated GPUs as the rank sees them: how many, which is current, what they are.

Made from the rank's settings (``MIRAGE_PROFILE``, ``MIRAGE_GPUS_PER_NODE``) and
the ``*_VISIBLE_DEVICES`` variables when this module loads (and again if the
runtime is rebuilt), and kept by the rank's runtime (``RUNTIME.device``,
``shim.rank.runtime``), which every layer reaches; its class stays in this
layer. It also holds the device layer's other per-rank state: the default
generators (``shim.device.rng``), the kernel errors kept for ``backward()``
(``shim.device.deferred``) and what runs on the first use of a GPU.

The current device is the main thread's for every thread that never chose
one, and a thread's own once it has (``set_device``, ``with
torch.cuda.device(i)``), as CUDA's is: ``nn.DataParallel`` runs each replica
in a thread that moves to its GPU, and the main thread must stay where it was. Threads that never choose (C++ code
such as the autograd engine allocating on its own threads) agree with the
main thread, where a CUDA thread would start on device 0.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

from shim.rank.runtime import RUNTIME
from shim.rank.settings import Settings
from wire.profiles import Profile, load_profile

#: The name the PrivateUse1 backend is registered under (C++ sees ``mirage:0``).
BACKEND = "mirage"


class _ThreadDevice(threading.local):
    gpu: int | None = None  # a class default: reading it is an attribute hit (every factory asks)


_thread = _ThreadDevice()


@dataclass
class DeviceState:
    profile: Profile
    physical: list[int]  # visible ordinal -> the node's GPU (after *_VISIBLE_DEVICES)
    main_current: int = 0  # the main thread's current device, and any thread's that chose none
    # torch.cuda.set_sync_debug_mode: 0 off, 1 warn, 2 error on an operation that waits for the GPU
    sync_debug: int = 0

    @property
    def current(self) -> int:
        """This thread's current device (see the module docstring)."""
        gpu = _thread.gpu
        return self.main_current if gpu is None else gpu

    @current.setter
    def current(self, gpu: int) -> None:
        if threading.current_thread() is threading.main_thread():
            self.main_current = gpu
        else:
            _thread.gpu = gpu

    # Like CUDA's, the runtime starts on first use (a tensor, set_device, current_device):
    # DeviceMesh only picks a device from LOCAL_RANK while torch.cuda.is_initialized() is False.
    initialized: bool = False

    #: run once, on the first use of a GPU (torch.cuda's queued lazy calls, e.g. seeds set before it)
    on_initialize: list = field(default_factory=list, repr=False, compare=False)
    #: one shim.device.rng.DeviceGenerator per GPU (torch.cuda.default_generators), made by that module
    generators: tuple = field(default=(), repr=False, compare=False)
    #: errors of kernels run on the autograd engine's threads, for backward()'s caller (shim.device.deferred)
    kept_errors: list = field(default_factory=list, repr=False, compare=False)
    kept_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def count(self) -> int:
        return len(self.physical)


#: Applied in this order, each narrowing what the one before left visible, as on ROCm.
VISIBILITY_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def visible_devices(gpus: int, env: dict[str, str]) -> list[int]:
    """The node's GPUs a process sees, in its order; like the runtime, a list stops at its first bad entry."""
    visible = list(range(gpus))
    for var in VISIBILITY_VARS:
        value = env.get(var)
        if value is None:
            continue
        narrowed = []
        for item in value.split(","):
            item = item.strip()
            if not item.isdigit() or int(item) >= len(visible) or visible[int(item)] in narrowed:
                break
            narrowed.append(visible[int(item)])
        visible = narrowed
    return visible


def _from_settings(settings: Settings) -> DeviceState:
    profile = load_profile(settings.profile)
    # the visibility variables are CUDA's and HIP's: read as the process starts, as their runtimes do
    return DeviceState(profile=profile, physical=visible_devices(settings.gpus_per_node, dict(os.environ)))


def _build(runtime) -> None:
    runtime.device = _from_settings(runtime.settings)


RUNTIME.attach(_build)


def synchronizing() -> None:
    """An operation that waits for the GPU ran while ``set_sync_debug_mode`` asks to hear of it: warn or raise,
    with c10's words (``warn_or_error_on_sync``)."""
    if RUNTIME.device.sync_debug == 2:
        raise RuntimeError("called a synchronizing CUDA operation")
    if RUNTIME.device.sync_debug == 1:
        warnings.warn("called a synchronizing CUDA operation", stacklevel=3)


def initialize() -> None:
    """The process's first use of a GPU: from now on ``torch.cuda.is_initialized()`` is True."""
    if RUNTIME.device.initialized:
        return
    RUNTIME.device.initialized = True
    for hook in RUNTIME.device.on_initialize:
        hook()


class _Allocating(threading.local):
    # A class default, so that reading it is an attribute hit: getattr(local, name, None) on a
    # missing name raises and catches an AttributeError, and every op asks (shim/tensor/wrapper.py).
    gpu: int | None = None


_alloc = _Allocating()


def check_index(index: int) -> int:
    """Validate a device ordinal the way the HIP runtime does."""
    if not 0 <= index < RUNTIME.device.count:
        raise RuntimeError(
            "HIP error: invalid device ordinal\n"
            "HIP kernel errors might be asynchronously reported at some other API call, "
            "so the stacktrace below might be incorrect.\n"
            "For debugging consider passing AMD_SERIALIZE_KERNEL=3"
        )
    return index


def allocation_override() -> int | None:
    """The GPU set by an enclosing :func:`allocating_on`, if any."""
    return _alloc.gpu


def allocation_device() -> int:
    """The GPU a new tensor with no GPU input lands on (override, else current)."""
    gpu = _alloc.gpu
    return RUNTIME.device.current if gpu is None else gpu


@contextmanager
def allocating_on(gpu: int):
    """Make C++-side allocations in this block land on emulated GPU ``gpu``."""
    prev = _alloc.gpu
    _alloc.gpu = gpu
    try:
        yield
    finally:
        _alloc.gpu = prev
