"""The numpy kernels collectives run: typed views, reductions, copies.

torch dtypes arrive by name. numpy has no bfloat16, so those buffers are
viewed as uint16 and reduced in float32, rounding back to nearest-even, which
is what RCCL's bf16 reduction kernels do.
"""

from __future__ import annotations

import numpy as np

from wire.schema import ReduceOp

#: dtype name (as torch spells it) -> numpy storage dtype
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(np_name)
    for name, np_name in {
        "float32": "float32",
        "float64": "float64",
        "float16": "float16",
        "bfloat16": "uint16",
        "int8": "int8",
        "uint8": "uint8",
        "int16": "int16",
        "int32": "int32",
        "int64": "int64",
        "bool": "bool",
    }.items()
}


class KernelError(ValueError):
    """A dtype or reduction the kernels cannot run (NCCL: ncclInvalidArgument)."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name."""
    try:
        return DTYPES[dtype].itemsize
    except KeyError:
        raise KernelError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}") from None


def typed(raw, dtype: str):
    """View a uint8 buffer (or :class:`Segmented` buffers) as elements of ``dtype`` (bfloat16 as uint16)."""
    itemsize(dtype)
    return raw.view(DTYPES[dtype])


class Segmented:
    """Consecutive buffers read as one flat array: a tensor that arrived in several data frames.

    Kernels only slice their inputs (``x[a:b]``); a slice inside one segment is
    a view, and one across a boundary (at most one per frame, frames being
    16 MiB) is a small copy. This spares the daemon a copy of every large
    input into one contiguous buffer.
    """

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.size = int(self.starts[-1])

    def __len__(self) -> int:
        return self.size

    def view(self, dtype) -> Segmented:
        """The same bytes as elements of ``dtype`` (segment sizes are multiples of every item size)."""
        return Segmented([p.view(dtype) for p in self.parts])

    def __getitem__(self, where: slice) -> np.ndarray:
        a, b, _ = where.indices(self.size)
        b = max(a, b)
        first = int(np.searchsorted(self.starts, a, side="right")) - 1
        pieces = []
        k = first
        while a < b:
            lo = int(self.starts[k])
            part = self.parts[k][a - lo : min(b, int(self.starts[k + 1])) - lo]
            pieces.append(part)
            a += len(part)
            k += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else self.parts[0][:0]


def _to_compute(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def _from_compute(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = a.astype(np.float32).view(np.uint32)
        bits = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
        return (bits >> 16).astype(np.uint16)
    return a


_BINARY = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_BOOL_BINARY = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.MAX: np.logical_or,
}


def check_reduce(op: ReduceOp, dtype: str) -> None:
    """Raise :class:`KernelError` unless ``op`` can reduce ``dtype`` (checked before a job runs)."""
    itemsize(dtype)
    if dtype == "bool" and op not in _BOOL_BINARY:
        raise KernelError(f"reduce op {op.value} is not defined for bool")


def reduce(parts: list[np.ndarray], op: ReduceOp, dtype: str, count: int | None = None) -> np.ndarray:
    """Reduce equally-shaped typed views element-wise; returns a new array. ``count``: how many ranks an average
    divides by, where ``parts`` are partial sums of several (across hosts); the parts by default."""
    check_reduce(op, dtype)
    fn = _BOOL_BINARY[op] if dtype == "bool" else _BINARY[op]
    acc = np.array(_to_compute(parts[0], dtype), copy=True)
    for p in parts[1:]:
        fn(acc, _to_compute(p, dtype), out=acc)
    _average(acc, op, count or len(parts))
    return _from_compute(acc, dtype)


def reduce_into(parts: list[np.ndarray], op: ReduceOp, dtype: str, out: np.ndarray, count: int | None = None) -> None:
    """Reduce equally-shaped typed views element-wise into ``out`` (which may alias the first two parts).

    Straight into the output, one pass per input, where the storage dtype is
    the compute dtype: no temporary to fill and copy (bfloat16 goes through
    :func:`reduce`'s float32 accumulator). ``out`` may be ``parts[0]`` or
    ``parts[1]`` (the first step reads both, element by element, before it
    writes), not a later one: each is read after ``out`` has been written.
    ``count``: as for :func:`reduce`.
    """
    if dtype == "bfloat16" or len(parts) < 2:
        out[...] = reduce(parts, op, dtype, count)
        return
    check_reduce(op, dtype)
    fn = _BOOL_BINARY[op] if dtype == "bool" else _BINARY[op]
    fn(parts[0], parts[1], out=out)
    for p in parts[2:]:
        fn(out, p, out=out)
    _average(out, op, count or len(parts))


def _average(acc: np.ndarray, op: ReduceOp, n: int) -> None:
    if op is ReduceOp.AVG:
        if acc.dtype.kind in "iu":
            # NCCL divides integer sums as C does, truncating toward zero; // floors
            inexact_neg = (acc < 0) & (acc % n != 0)
            acc //= n
            acc += inexact_neg
        else:
            acc /= n
