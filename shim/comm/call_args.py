"""What the process group takes from torch's arguments: a collective's reduction, its tensors' GPU and CPU data
(refused as ProcessGroupNCCL refuses them), where its output goes, and when CPU tensors go to gloo instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MappingProxyType

import torch
import torch.distributed as dist

from shim.ops.functional import host_gpu
from shim.tensor.wrapper import MirageTensor
from wire import schema as s

_REDUCE = MappingProxyType({
    dist.ReduceOp.RedOpType.SUM: s.ReduceOp.SUM,
    dist.ReduceOp.RedOpType.AVG: s.ReduceOp.AVG,
    dist.ReduceOp.RedOpType.PRODUCT: s.ReduceOp.PRODUCT,
    dist.ReduceOp.RedOpType.MIN: s.ReduceOp.MIN,
    dist.ReduceOp.RedOpType.MAX: s.ReduceOp.MAX,
})
#: ``reduction``'s answer for each plain reduction, made once (callers only unpack it)
_KEYWORDS = {red: {"reduce_op": op} for red, op in _REDUCE.items()}


def reduction(opts) -> dict:
    """A :class:`~shim.transport.transports.Call`'s keywords for the options' reduction (C++ hands us a ReduceOp wrapping a RedOpType).

    ``premul_sum`` (``dist._make_nccl_premul_sum(factor)``) is NCCL's sum of
    inputs each scaled by ``factor``: the scaling happens on the staged copy,
    and the daemon sums.
    """
    if opts is None:
        return _KEYWORDS[dist.ReduceOp.RedOpType.SUM]
    red = opts.reduceOp
    kw = _KEYWORDS.get(red.op)  # one lookup for the plain reductions (a third of the time it took)
    if kw is not None:
        return kw
    if red.op == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = red.factor
        return {"reduce_op": s.ReduceOp.SUM, "premul": factor.item() if isinstance(factor, torch.Tensor) else factor}
    op = _REDUCE.get(red.op)
    if op is None:
        raise ValueError(f"reduce op {red.op.name} is not supported by the emulated NCCL")
    return {"reduce_op": op}


def gpu_of(t: torch.Tensor) -> int:
    """The emulated GPU of a collective's tensor."""
    return t._gpu if isinstance(t, MirageTensor) else host_gpu()


def flat(t: torch.Tensor) -> torch.Tensor:
    """The CPU data of a collective's tensor, refused as ProcessGroupNCCL refuses it."""
    if isinstance(t, MirageTensor):
        t = t._elem
    elif host_gpu() is None or t.device.type not in ("cpu", "meta"):  # meta: estimate mode's, without values
        raise ValueError(f"Tensors must be CUDA and dense; got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError("Tensors must be contiguous")
    return t


def any_emulated(args) -> bool:
    """Whether any argument of a collective, its lists opened (two levels: lists of lists of tensors),
    is an emulated GPU's tensor; stops at the first (usually the first argument's first tensor)."""
    for a in args:
        if isinstance(a, MirageTensor):
            return True
        if isinstance(a, list):
            for b in a:
                if isinstance(b, MirageTensor) or (
                    isinstance(b, list) and any(isinstance(c, MirageTensor) for c in b)
                ):
                    return True
    return False


def cpu_via_gloo(method):
    """Send a collective of CPU tensors to the group's gloo half, or refuse it as ProcessGroupNCCL does."""

    @functools.wraps(method)
    def route(self, *args, **kwargs):
        if any_emulated(args) or host_gpu() is not None:
            return method(self, *args, **kwargs)
        if self._cpu is None:
            raise RuntimeError("No backend type associated with device type cpu")
        return getattr(self._cpu, method.__name__)(*args, **kwargs)

    return route


def into(dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A ``deliver`` that copies a collective's flat output into ``dst``."""

    def deliver(flat: torch.Tensor) -> None:
        dst.copy_(flat.view(dst.shape))

    deliver.targets = [dst]  # what a later collective must not read before this one is delivered
    return deliver


def into_each(dsts: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """A ``deliver`` that splits a collective's flat output over ``dsts``, in order."""

    def deliver(flat: torch.Tensor) -> None:
        at = 0
        for d in dsts:
            d.copy_(flat[at : at + d.numel()].view(d.shape))
            at += d.numel()

    deliver.targets = dsts
    return deliver
