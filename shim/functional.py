"""Functional collectives (``torch.ops._c10d_functional``: DTensor, FSDP2, ``clip_grad_norm_`` on DTensors)
on emulated tensors.

``MirageTensor.__torch_dispatch__`` unwraps every op's arguments, so these ops
reach the process group with plain CPU tensors; while one runs, this module
says which emulated GPU that data belongs to.
"""

from __future__ import annotations

import threading

_host = threading.local()


def functional_collective(func, args, kwargs, gpu: int):
    """Run functional collective ``func`` on the CPU data (``args``) of GPU ``gpu``'s tensors."""
    _host.gpu = gpu
    try:
        return func(*args, **kwargs)
    finally:
        _host.gpu = None


def host_gpu() -> int | None:
    """The emulated GPU whose unwrapped data the running functional collective holds, or None."""
    return getattr(_host, "gpu", None)
