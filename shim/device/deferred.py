"""Errors raised by emulated kernels during ``backward()``, re-raised where backward was called.

The autograd engine runs a device's backward on its own thread. There, an
exception leaving ``__torch_dispatch__`` makes torch's Python device guard call
back into Python while the exception unwinds, and the process aborts
(``terminate called without an active exception``). So the kernel's error is
kept, the failed op returns zeros of the right shape so the engine can finish
the graph, and ``backward()``/``autograd.grad()`` raise the first kept error
as they return — on a GPU the same error reaches the same caller.
"""

from __future__ import annotations

import torch

from shim.rank.runtime import RUNTIME


def in_backward() -> bool:
    """Whether this thread is running the autograd engine's work (where raising aborts)."""
    return torch._C._current_graph_task_id() != -1


def keep(error: BaseException) -> None:
    """Keep ``error`` for the backward() caller to raise."""
    d = RUNTIME.device
    with d.kept_lock:
        d.kept_errors.append(error)


def defer(error: BaseException, func, args, kwargs):
    """Keep ``error`` for the backward() caller; return stand-in results shaped as ``func``'s would be."""
    keep(error)
    if func._schema.is_mutable and args:
        return args[0]  # in-place: the argument itself
    meta = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"),
                                             (args, kwargs or {}))
    try:
        out = func(*meta[0], **meta[1])
    except Exception:
        raise error from None  # no shape to stand in with: nothing better than torch's own behaviour
    device = next((a.device for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda m: torch.zeros(m.shape, dtype=m.dtype, device=device), out
    )


def _raise_kept() -> None:
    d = RUNTIME.device
    with d.kept_lock:
        if not d.kept_errors:
            return
        first = d.kept_errors[0]
        d.kept_errors.clear()
    raise first


def install() -> None:
    """Make backward()/autograd.grad() raise what the device thread kept."""
    run = torch.autograd.graph._engine_run_backward

    def engine_run_backward(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        finally:
            _raise_kept()

    torch.autograd.graph._engine_run_backward = engine_run_backward
    torch.autograd._engine_run_backward = engine_run_backward
