"""c10d's convenience overloads of a process group's methods, turned into the options forms.

``torch.distributed``'s functions call a group's methods in one form,
``(tensors, options)``; C++ ``ProcessGroup`` also binds shorter forms that
code calls on a group directly — DDP's join hook calls ``pg.allreduce(tensor)``,
and user code ``pg.broadcast(t, 0)`` or ``pg.barrier()``. A Python process group
replaces every binding of a name, so :func:`c10d_forms` takes each short form
as ProcessGroup's pybind11 overloads do and hands the method its options form.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from types import MappingProxyType

import torch
import torch._C._distributed_c10d as c10d_options  # every *Options class (dist lacks AllgatherOptions)
import torch.distributed as dist

_OPS = (dist.ReduceOp, dist.ReduceOp.RedOpType)


def _options(cls, timeout: timedelta | None = None, **fields):
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout is not None:
        opts.timeout = timeout
    return opts


def _op(value) -> dist.ReduceOp:
    return value if isinstance(value, dist.ReduceOp) else dist.ReduceOp(value)


def _broadcast(tensor, root, timeout=None):
    return ([tensor], _options(c10d_options.BroadcastOptions, timeout, rootRank=root))


def _allreduce(tensors, op=dist.ReduceOp.SUM, timeout=None):
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    return (tensors, _options(c10d_options.AllreduceOptions, timeout, reduceOp=_op(op)))


def _reduce(tensor, root, op=dist.ReduceOp.SUM, timeout=None):
    return ([tensor], _options(c10d_options.ReduceOptions, timeout, rootRank=root, reduceOp=_op(op)))


def _allgather(outputs, input, timeout=None):
    return ([outputs], [input], _options(c10d_options.AllgatherOptions, timeout))


def _gather(outputs, input, root, timeout=None):
    # as c10d's overload: a rank without outputs (not the root) passes no list of lists
    return ([outputs] if outputs else [], [input], _options(c10d_options.GatherOptions, timeout, rootRank=root))


def _scatter(output, inputs, root, timeout=None):
    return ([output], [inputs] if inputs else [], _options(c10d_options.ScatterOptions, timeout, rootRank=root))


def _reduce_scatter(output, inputs, op=dist.ReduceOp.SUM, timeout=None):
    return ([output], [inputs], _options(c10d_options.ReduceScatterOptions, timeout, reduceOp=_op(op)))


def _barrier(timeout=None):
    return (_options(c10d_options.BarrierOptions, timeout),)


#: method name -> (whether a call is the short form, the short form's arguments -> the options form's)
_FORMS = MappingProxyType({
    "broadcast": (lambda a, kw: bool(a) and isinstance(a[0], torch.Tensor), _broadcast),
    "allreduce": (lambda a, kw: (bool(a) and isinstance(a[0], torch.Tensor)) or "op" in kw
                  or (len(a) > 1 and isinstance(a[1], _OPS)), _allreduce),
    "reduce": (lambda a, kw: bool(a) and isinstance(a[0], torch.Tensor), _reduce),
    "allgather": (lambda a, kw: len(a) > 1 and isinstance(a[1], torch.Tensor), _allgather),
    "gather": (lambda a, kw: len(a) > 1 and isinstance(a[1], torch.Tensor), _gather),
    "scatter": (lambda a, kw: bool(a) and isinstance(a[0], torch.Tensor), _scatter),
    "reduce_scatter": (lambda a, kw: bool(a) and isinstance(a[0], torch.Tensor), _reduce_scatter),
    "barrier": (lambda a, kw: "timeout" in kw or (bool(a) and isinstance(a[0], timedelta)), _barrier),
})


def c10d_forms(method):
    """Let ``method`` (named as a ``ProcessGroup`` method) also be called in c10d's short forms."""
    is_short, to_options = _FORMS[method.__name__]

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if is_short(args, kwargs):
            args, kwargs = to_options(*args, **kwargs), {}
        return method(self, *args, **kwargs)

    return call
