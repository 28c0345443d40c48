"""Pinned host memory: ``pin_memory()`` and ``is_pinned()`` as on a GPU build.

A CPU build refuses to pin ("Cannot access accelerator device"), which breaks
``DataLoader(pin_memory=True)``. Here pinning copies, as a GPU build does
(into page-locked memory there, ordinary host memory here), and the copy
answers ``is_pinned()`` with True for as long as it lives.
"""

from __future__ import annotations

import weakref

import torch

_pinned: dict[int, weakref.ref] = {}  # id -> the pinned tensor (a WeakSet would compare tensors with ==)


def _is_pinned_object(t: torch.Tensor) -> bool:
    ref = _pinned.get(id(t))
    return ref is not None and ref() is t


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t.pin_memory()``: a pinned copy of a host tensor (a pinned one is returned as it is)."""
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned")
    if _is_pinned_object(t):
        return t
    out = t.clone()
    key = id(out)
    _pinned[key] = weakref.ref(out, lambda _, key=key: _pinned.pop(key, None))
    return out


def is_pinned(t: torch.Tensor) -> bool:
    """``t.is_pinned()``: whether ``t`` came from :func:`pin` (or is a view of such a tensor)."""
    return _is_pinned_object(t) or (t._base is not None and _is_pinned_object(t._base))
