"""Turn the emulation on inside this process, once ``torch`` has been imported."""

from __future__ import annotations

import torch

from shim.rank.runtime import RUNTIME

class _Backend:
    """The device module torch keeps for the renamed PrivateUse1 backend."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def current_device() -> int:
        return 0  # C++ sees one device; emulated GPU indices live on the tensors

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list:
        return [torch.float16, torch.bfloat16]


def activate() -> None:
    """Register the backend, the tensor subclass factories, the cuda surface and the mode."""
    if not RUNTIME.once.first("activate"):
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from shim.cuda import engine
    from shim.device.state import BACKEND
    from shim.memory import pinned

    pinned.install()  # its C++ hooks first: torch keeps the first PrivateUse1 hooks registered
    engine.install()  # and the C++ device guard (the first registered is kept too)
    _setup_privateuseone_for_python_backend(rename=BACKEND, backend_module=_Backend())
    from shim.clock import clock

    # before anything that registers an exit hook: the rank's trace is written after the collectives
    # still in flight have completed (exit hooks run last registered first)
    clock.install(RUNTIME.device.profile)
    from shim.comm import local as local_comm
    from shim.compile import torch_compile
    from shim.cuda import api as cuda
    from shim.cuda import gpu_builds, mode
    from shim.device import autocast, deferred
    from shim.ops import attention
    from shim.tensor import fast_dispatch
    from shim.tensor import wrapper as tensor

    tensor.register_factories()
    tensor.register_foreach()
    fast_dispatch.install()  # views and common ops in C++ where it can be built
    autocast.install()
    deferred.install()
    attention.install(tensor.MirageTensor)  # CPU kernels of CUDA-only ops, higher-order ops, SDPA's choice
    torch_compile.install()
    cuda.install()
    gpu_builds.install()  # DeepSpeed's CUDA/HIP ops, refused in one line
    local_comm.install()  # torch.cuda.comm / torch.cuda.nccl among this process's GPUs (nn.DataParallel)
    mode.install()
    from shim.comm import c10d_patches, sharding, world
    from shim.ops import syncbn
    from shim.tensor import params, serialization

    c10d_patches.install()  # the "nccl" backend (shim/comm/process_group.py)
    serialization.install()  # torch.load(map_location="cuda:i")
    syncbn.install()  # the CUDA-only kernels of nn.SyncBatchNorm
    sharding.install()  # FSDP2's storage freeing, DTensor.device
    params.install()  # Module.to and .data = keep a tensor's identity across host and GPU
    world.install()  # init_process_group tells the daemon who waits for whom (after c10d_patches.install)
    _register_rank()


def _register_rank() -> None:
    """Tell the daemon which pid is which rank, so the console can name it (the rank claimed at start-up)."""
    from shim.comm import registration

    if RUNTIME.claimed_rank is not None:
        registration.register_rank(RUNTIME.claimed_rank)
