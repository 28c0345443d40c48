"""Pinned host memory: ``pin_memory()``, ``is_pinned()`` and ``empty(pin_memory=True)`` as on a GPU build.

torch takes a custom device's pinned host allocator only from C++: from the
PrivateUse1 hooks, which torch.utils.backend_registration registers from
Python without one (``Tensor.pin_memory()`` then fails, and so does DDP's
reducer, which copies its map of used parameters through a pinned buffer with
``find_unused_parameters`` or ``static_graph``). :func:`install` loads the
library built from ``shim/native/pinned_host.cpp`` (``shim/native/build.py``) and
registers its hooks in their place: torch's own pinning then works in every
thread (a DataLoader's pin-memory thread too), and ``is_pinned()`` is True for
exactly what was pinned. The memory is ordinary host memory, as copying it to
an emulated GPU is a host copy.

Where the library cannot be built (no C++ compiler), :data:`NATIVE_ERROR` says
why, and a fallback stands in: ``pin_memory()`` copies, and the copy answers
``is_pinned()`` with True for as long as it lives, in the threads the mode
follows (in a DataLoader's pin-memory thread it is an ordinary copy);
``empty(pin_memory=True)`` still raises; DDP refuses
``find_unused_parameters`` and ``static_graph`` naming the reason.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from shim.memory import allocator  # noqa: F401 - it builds RUNTIME.allocator, which keeps the fallback's tensors
from shim.native import build as native_build
from shim.rank.runtime import RUNTIME

#: None once the native allocator is torch's; otherwise why it is not (one line)
NATIVE_ERROR: str | None = "shim.memory.pinned.install() has not run"

_native: ctypes.CDLL | None = None  # kept: torch holds pointers into it for the process's life
_fallback_lib: torch.library.Library | None = None


def install() -> None:
    """Make pinning work: the native hooks if they can be had, else the fallback.

    Must run before ``_setup_privateuseone_for_python_backend``, which registers
    hooks without an allocator (torch keeps the first hooks registered).
    """
    global NATIVE_ERROR, _native
    try:
        _native = native_build.load(native_build.SOURCE, "the pinned host allocator")
    except native_build.BuildError as e:
        NATIVE_ERROR = str(e)
    else:
        NATIVE_ERROR = None if _native.mirage_register_pinned_host() else "other PrivateUse1 hooks came first"
    if NATIVE_ERROR is not None:
        _install_fallback()


def _install_fallback() -> None:
    global _fallback_lib
    _fallback_lib = torch.library.Library("aten", "IMPL")
    # torch's own pin_memory() (DataLoader's, also in its pin-memory thread) reaches this kernel
    _fallback_lib.impl("_pin_memory", _host_copy, "CPU")


def _host_copy(self, device=None):
    return self.clone(memory_format=torch.contiguous_format)


def _is_pinned_object(t: torch.Tensor) -> bool:
    # RUNTIME.allocator.pinned: id -> the pinned tensor (a WeakSet would compare tensors with ==)
    ref = RUNTIME.allocator.pinned.get(id(t))
    return ref is not None and ref() is t


def pin(t: torch.Tensor) -> torch.Tensor:
    """Fallback ``t.pin_memory()``: a pinned copy of a host tensor (a pinned one is returned as it is)."""
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned")
    if _is_pinned_object(t):
        return t
    out = t.clone()
    key = id(out)
    pinned = RUNTIME.allocator.pinned
    pinned[key] = weakref.ref(out, lambda _, key=key: pinned.pop(key, None))
    return out


def is_pinned(t: torch.Tensor) -> bool:
    """Fallback ``t.is_pinned()``: whether ``t`` came from :func:`pin` (or is a view of such a tensor)."""
    return _is_pinned_object(t) or (t._base is not None and _is_pinned_object(t._base))
