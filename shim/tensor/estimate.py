"""Estimate mode (``mirage run --exec-mode estimate``): emulated tensors without their values.

Inside each emulated tensor of more than :data:`VALUES_MAX_BYTES` is a meta tensor:
shape, dtype, strides and a storage of the right size, no data. Smaller ones keep
their values, what programs and frameworks compute from and exchange to agree on
shapes and counts (DDP's check of every rank's parameters, ``all_gather_object``'s
bytes, step counters); an op over both gives a meta tensor. Ops run through torch's
meta kernels and are clocked as in clocked mode; the caching allocator counts every storage, so
``torch.cuda.memory_allocated()`` and the out-of-memory error are those of the GPU;
collectives are matched, booked and timed without moving bytes
(``shim.transport.shapes.ShapesTransport``). A model of any size runs on the host.

Where a program needs a value the rule is fixed (docs/clocked.md, "Estimate mode"):

- a value read on the host (``.item()``, ``.tolist()``, ``.cpu()``, printing's data)
  is a placeholder, zeros, with one notice per call site on stderr;
- an op whose output's *shape* depends on the values (``nonzero``, boolean-mask
  indexing, ``unique``) cannot be shaped: a one-line error naming the op and the site.
"""

from __future__ import annotations

import sys

import torch

from shim.rank.runtime import RUNTIME
from shim.rank.call_site import call_site

#: the largest emulated tensor that keeps its values in estimate mode
VALUES_MAX_BYTES = 1 << 20


def mixed(args) -> bool:
    """Whether ``args`` (an op's unwrapped arguments) hold tensors with values beside ones without: the op
    must then run over meta tensors only (a CPU kernel handed a meta tensor would read no memory)."""
    meta = real = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                meta = True
            else:
                real = True
        elif isinstance(a, (list, tuple)) and a and not isinstance(a, torch.Size):
            for t in a:
                if isinstance(t, torch.Tensor):
                    meta, real = meta or t.is_meta, real or not t.is_meta
        if meta and real:
            return True
    return False


def run_on_meta(run, uargs: list, ukwargs: dict):
    """``run`` (an op's kernel) over meta tensors only."""
    return run(*on_meta(uargs), **dict(zip(ukwargs, on_meta(ukwargs.values()))))


def written(func, args: tuple, kwargs: dict | None) -> list:
    """The arguments ``func`` writes: its first (in-place ops), its ``out=``."""
    schema = func._schema.arguments
    hit = []
    if schema and args and schema[0].alias_info is not None and schema[0].alias_info.is_write:
        hit.extend(args[0] if isinstance(args[0], (list, tuple)) else [args[0]])  # the foreach ops: a list
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        hit.extend(out if isinstance(out, (list, tuple)) else [out])
    return hit


def without_values(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s geometry over a meta storage of its storage's size."""
    storage = torch.UntypedStorage(t.untyped_storage().nbytes(), device="meta")
    return torch.empty(0, dtype=t.dtype, device="meta").set_(storage, t.storage_offset(), t.size(), t.stride())


def on_meta(args) -> list:
    """``args`` with every tensor that has values as a meta tensor (in lists and tuples too)."""
    return [a.to("meta") if isinstance(a, torch.Tensor) and not a.is_meta
            else type(a)(on_meta(a)) if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size)
            else a
            for a in args]


def placeholder(t: torch.Tensor, what: str) -> torch.Tensor:
    """Host zeros standing for the values of ``t`` (a meta tensor) that ``what`` reads."""
    _notice(what)
    return torch.zeros(t.shape, dtype=t.dtype)


def scalar(t: torch.Tensor, what: str):
    """The number standing for ``t.item()``: zero of its type."""
    _notice(what)
    return torch.zeros((), dtype=t.dtype).item()


def refuse(func) -> None:
    """An op whose output's shape depends on the values: there is no shape to give it."""
    name = str(func).removesuffix(".default")
    raise RuntimeError(
        f"mirage: {name} at {call_site()} needs the values of its input to shape its output, and "
        "--exec-mode estimate keeps none; run the program with --exec-mode clocked, or keep this step "
        "off the estimated path"
    )


def _notice(what: str) -> None:
    notice(what, "reads a value, which --exec-mode estimate does not keep: it reads zeros")


def notice(what: str, happens: str) -> None:
    """Say on stderr, once per call site in the program, what estimate mode does instead of a GPU."""
    site = call_site()
    if RUNTIME.once.first(f"estimate:{what}:{site}"):
        print(f"mirage: {what} at {site} {happens} (this notice is printed once per call site)", file=sys.stderr,
              flush=True)


_aten = torch.ops.aten


def run_without_values(run, func, args: tuple, kwargs: dict | None, uargs: list, ukwargs: dict):
    """An op over tensors with values and tensors without, run over meta tensors only. What it writes holds no
    values either from then on: an emulated tensor's data becomes a meta tensor (and its base's, for a view:
    the values of the whole storage are unknown); a host tensor gets zeros, said once."""
    out = run_on_meta(run, uargs, ukwargs)
    written_to = written(func, args, kwargs)
    for target in written_to:
        if _emulated(target):
            if not target._elem.is_meta:
                lose_values(target)
        elif isinstance(target, torch.Tensor) and not target.is_meta:
            target.copy_(placeholder(target, f"{func} writing a host tensor"))
    if isinstance(out, torch.Tensor) and len(written_to) == 1:  # it returns what it wrote: that, not the meta copy
        return written_to[0]._elem if _emulated(written_to[0]) else written_to[0]
    return out


def lose_values(w) -> None:
    """The emulated tensor ``w`` (and the storage it views) holds no values from now on."""
    base = w if w._src is None else w._src
    base._elem = without_values(base._elem)
    RUNTIME.allocator.moved(base)  # counted anew under its meta storage
    if base is not w:
        w._elem = base._elem.as_strided(w.size(), w.stride(), w.storage_offset())


def host_read(func, uargs: list):
    """An op that reads values on the host, or shapes its output by them, of a tensor without values."""
    if func is _aten._local_scalar_dense.default:
        return scalar(uargs[0], "Tensor.item()")
    if func is _aten.copy_.default:  # into a host tensor
        return uargs[0].copy_(placeholder(uargs[1], "a copy to the host (Tensor.copy_)"))
    refuse(func)


def _emulated(t) -> bool:
    """Whether ``t`` is an emulated tensor (shim/tensor/wrapper.py's, which holds its data as ``_elem``)."""
    return isinstance(t, torch.Tensor) and getattr(t, "_elem", None) is not None
