"""Turn the emulation on inside this process, once ``torch`` has been imported."""

from __future__ import annotations

import torch

_done = False


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


def activate() -> None:
    """Register the backend, the tensor subclass factories, the cuda surface and the mode."""
    global _done
    if _done:
        return
    _done = True
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from shim.device import BACKEND

    _setup_privateuseone_for_python_backend(rename=BACKEND, backend_module=_Backend())
    from shim import cuda, mode, tensor

    tensor.register_factories()
    cuda.install()
    mode.install()
    from shim import backend

    backend.install()
