"""Functional collectives (``torch.ops._c10d_functional``: DTensor, FSDP2, ``clip_grad_norm_`` on DTensors)
on emulated tensors.

``MirageTensor.__torch_dispatch__`` unwraps every op's arguments, so these ops
reach the process group with plain CPU tensors; while one runs, this module
says which emulated GPU that data belongs to.
"""

from __future__ import annotations

import threading

import torch

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
