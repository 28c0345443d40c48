"""Functional collectives (``torch.ops._c10d_functional``: DTensor, FSDP2, ``clip_grad_norm_`` on DTensors)
on emulated tensors.

``MirageTensor.__torch_dispatch__`` unwraps every op's arguments, so these ops
reach the process group with plain CPU tensors; while one runs, this module
says which emulated GPU that data belongs to.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._pytree import tree_leaves

_host = threading.local()


def functional_collective(func, args, kwargs, gpu: int):
    """Run functional collective ``func`` on the CPU data (``args``) of GPU ``gpu``'s tensors."""
    _host.gpu = gpu
    try:
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args, kwargs))):
            return _without_values(func, args, kwargs)
        return func(*args, **kwargs)
    finally:
        _host.gpu = None


def _without_values(func, args: tuple, kwargs: dict):
    """A functional collective of estimate mode's tensors without values (meta tensors inside).

    torch's Meta kernels of these ops and of the c10d ops under them only shape the outputs: no
    collective would be posted, matched, checked or timed. So each is posted here to the group's
    process group itself (``shim.transport.shapes``: the request alone), waited for, and its output
    made with its shape.
    """
    import torch.distributed as dist

    name = func._schema.name.split("::", 1)[1]
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return args[0]  # posted and waited for already
    pg = dist.distributed_c10d._resolve_process_group(args[-1])._get_backend(torch.device("cuda"))
    if name.endswith("_out"):
        out = kwargs["out"]
        return out.copy_(_without_values(getattr(torch.ops._c10d_functional, name[:-4]).default, args, {}))
    if name.endswith("_coalesced") or name.endswith("_coalesced_"):
        single = getattr(torch.ops._c10d_functional, name.replace("_coalesced", "")).default
        return [_without_values(single, (t, *args[1:]), {}) for t in args[0]]
    t = args[0]
    if name in ("all_reduce", "all_reduce_"):
        out = t if name.endswith("_") else t.clone()
        pg.allreduce([out], _options(dist.AllreduceOptions(), args[1])).wait()
    elif name in ("broadcast", "broadcast_"):
        out = t if name.endswith("_") else t.clone()
        opts = dist.BroadcastOptions()
        opts.rootRank = args[1]
        pg.broadcast([out], opts).wait()
    elif name == "all_gather_into_tensor":
        out = t.new_empty((t.shape[0] * args[1], *t.shape[1:]))
        pg._allgather_base(out, t).wait()
    elif name == "reduce_scatter_tensor":
        out = t.new_empty((t.shape[0] // args[2], *t.shape[1:]))
        pg._reduce_scatter_base(out, t, _options(dist.ReduceScatterOptions(), args[1])).wait()
    elif name == "all_to_all_single":
        rows = sum(args[1]) if args[1] else t.shape[0]
        out = t.new_empty((rows, *t.shape[1:]))
        pg.alltoall_base(out, t, list(args[1]), list(args[2])).wait()
    else:
        raise RuntimeError(f"mirage: {func} of tensors without values is not supported by --exec-mode estimate")
    return out


def _options(opts, reduce_op: str):
    """c10d options naming the reduction a functional collective names as a string ("sum", "avg", ...)."""
    import torch.distributed as dist

    opts.reduceOp = getattr(dist.ReduceOp, reduce_op.upper())
    return opts


def host_gpu() -> int | None:
    """The emulated GPU whose unwrapped data the running functional collective holds, or None."""
    return getattr(_host, "gpu", None)


# ---------------------------------------------------------------- in graphs torch.compile traces
#
# A compiled graph runs on the host tensors inside the emulated ones (shim/compile/torch_compile.py), so the
# collectives in it would reach the "nccl" group with plain CPU tensors and no GPU named: each is
# traced as an op of this library instead, the same collective with the GPU whose data it holds,
# which the compiled code runs as functional_collective does (through the process group, the
# transports and the daemon's ledger) and waits for before it returns (the graph's own wait_tensor
# then finds nothing to wait for).

_lib: torch.library.Library | None = None
_TRACED: dict = {}  # the _c10d_functional op -> this library's


def _traced_op(func):
    """The op of this library standing for functional collective ``func`` (defined on first use)."""
    global _lib
    op = _TRACED.get(func)
    if op is not None:
        return op
    if _lib is None:
        _lib = torch.library.Library("mirage_c10d", "DEF")
    schema = func._schema
    namespace, name = schema.name.split("::", 1)
    name = f"{'autograd_' if namespace.endswith('autograd') else ''}{name}_{schema.overload_name or 'default'}"
    text = str(schema)  # "_c10d_functional::all_reduce(Tensor input, ...) -> Tensor": the same, with the GPU
    params, returns = text[text.index("(") + 1:].split(") -> ", 1)
    sep = ", " if any(a.kwarg_only for a in schema.arguments) else ", *, "
    _lib.define(f"{name}({params}{sep}int gpu) -> {returns}")

    def run(*args, gpu, **kwargs):
        out = functional_collective(func, args, kwargs, gpu)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            torch.ops._c10d_functional.wait_tensor(t)
        return out

    def fake(*args, gpu, **kwargs):
        return func(*args, **kwargs)

    _lib.impl(name, run, "CPU")
    _lib.impl(name, fake, "Meta")
    op = _TRACED[func] = getattr(torch.ops.mirage_c10d, name).default
    return op


def traced_collective(func, args, kwargs, gpu: int):
    """Functional collective ``func`` met while torch.compile traces: its op of this library (see above).

    The in-place forms (``all_reduce_``, ``*_out``) are traced as the functional
    form and a copy into their target, as functionalization would write them.
    """
    name = func._schema.name.split("::", 1)[1]
    if func is torch.ops._c10d_functional.wait_tensor.default:
        return func(*args, **kwargs)
    if name.endswith("_out"):
        kwargs = dict(kwargs)
        target = kwargs.pop("out")
        return target.copy_(traced_collective(getattr(torch.ops._c10d_functional, name[:-4]).default,
                                              args, kwargs, gpu))
    if name.endswith("_"):
        out = traced_collective(getattr(torch.ops._c10d_functional, name[:-1]).default, args, kwargs, gpu)
        if isinstance(out, (list, tuple)):
            for t, o in zip(args[0], out):
                t.copy_(o)
            return args[0]
        return args[0].copy_(out)
    return _traced_op(func)(*args, **kwargs, gpu=gpu)
