"""``torch.compile`` on the emulated GPUs: the eager backends run eagerly, the others refuse clearly.

Inductor generates Triton/HIP kernels for a real GPU, and dynamo cannot trace
through the emulation (its TorchFunctionMode and tensor subclass). The
``eager`` and ``aot_eager`` backends only capture graphs to run the same ops
eagerly, so they are honoured by running the function as it is — same results.
Any other backend raises at the ``torch.compile`` call, naming it, unless
``MIRAGE_COMPILE=eager`` asks for every ``torch.compile`` to run eagerly (for
programs that compile unconditionally).
"""

from __future__ import annotations

import os

import torch

EAGER_BACKENDS = ("eager", "aot_eager")


def _backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


def compile(model=None, *, backend="inductor", disable: bool = False, **options):  # noqa: A001 - torch's name
    """``torch.compile``: returns ``model`` unchanged for the eager backends; refuses the rest."""
    name = _backend_name(backend)
    if not disable and name not in EAGER_BACKENDS and os.environ.get("MIRAGE_COMPILE") != "eager":
        raise RuntimeError(
            f"torch.compile(backend={name!r}) is not supported on mirage's emulated GPUs: it would generate kernels "
            "for a real GPU, and dynamo cannot trace through the emulation. Use backend='eager' or 'aot_eager' "
            "(run eagerly, same results), or set MIRAGE_COMPILE=eager to run every torch.compile eagerly"
        )
    if model is None:  # used as @torch.compile(...)
        return lambda fn: fn
    return model


def install() -> None:
    """Replace ``torch.compile`` (``nn.Module.compile`` calls it too)."""
    torch.compile = compile
