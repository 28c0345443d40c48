"""Clocked mode prices a Triton kernel by what its programs did as Triton's interpreter ran them.

A Triton kernel on an emulated GPU runs in Triton's interpreter (shim/compile/triton_runtime.py): one
program of the grid after another, over the tensors' host memory. The aten dispatch that times eager ops
(shim/clock/clock.py) sees none of it, but the interpreter's builder, which every program's memory ops and
dots go through, sees what the GPU would do. So, in clocked mode only, it counts over the whole grid:

- bytes: each ``tl.load`` and ``tl.store`` (through block pointers and tensor descriptors too) moves
  its element for each lane its mask leaves on; an atomic reads and writes it (twice the bytes);
- FLOPs: each ``tl.dot`` is 2·M·N·K, at the matrix-core rate of its inputs' dtype
  (:func:`shim.clock.roofline.compute_seconds`). Elementwise math is free next to its bytes, as for
  eager ops and compiled kernels: on mi350x it would bind only past ~13 FLOPs per byte moved (more on
  the others), and the interpreter runs reductions and libdevice math in numpy, past the builder, so
  a count of it would be partial anyway.

The launch is then one kernel on the current stream of the current GPU, named after the kernel's
function and timed by the roofline (:func:`shim.clock.roofline.roofline_cost`; a kernel without a dot by
its bytes alone, as a bytes-only op). The autotuner's benchmarking runs are the host's choosing of a
config, not the program's work (:func:`unpriced`): only the launch with the chosen config is priced.
Functional mode installs nothing, so its interpreter runs exactly as before.

The module is imported as a rank starts (by shim/compile/triton_runtime.py), before the program imports
torch, so torch and the roofline are imported where a launch is priced, not here.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import MappingProxyType

from shim.rank.runtime import RUNTIME

#: Triton's name of a dot's input dtype -> torch's, where the roofline has a rate of its own for it
_DOT_DTYPES = MappingProxyType({"fp16": "float16", "bf16": "bfloat16", "fp64": "float64"})


class _Counts:
    """What one launch's programs did: bytes moved, and dot FLOPs by the dtype they run in."""

    __slots__ = ("nbytes", "dot_flops")

    def __init__(self) -> None:
        self.nbytes = 0
        self.dot_flops: dict = {}  # torch dtype -> FLOPs


class _Launch(threading.local):
    counts: _Counts | None = None  # the launch this thread's interpreter runs and counts (None: none)
    host: bool = False  # inside the autotuner's benchmarker: its launches are the host's work


_launch = _Launch()


@contextmanager
def unpriced():
    """The Triton launches within are the host's work (the autotuner timing its configs): left unpriced."""
    before = _launch.host
    _launch.host = True
    try:
        yield
    finally:
        _launch.host = before


def install(interpreter) -> None:
    """In clocked mode, once Triton is imported: count what the interpreter's programs do, price each launch."""
    import numpy as np

    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle

    def lanes(ptrs, mask) -> int:
        # block pointers and descriptors pass their mask as a bare numpy array; the semantic layer
        # broadcasts a mask to its pointers' shape, and should one come smaller, each of its lanes
        # stands for as many pointers
        on = mask.data if isinstance(mask, handle) else mask
        return int(np.count_nonzero(on)) * (ptrs.data.size // on.size)

    def element_bytes(ptrs) -> int:
        return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)  # int1 is stored as a byte

    def counting(method, nbytes):
        def count(self, *args, **kwargs):
            counts = _launch.counts
            if counts is not None:
                counts.nbytes += nbytes(*args)  # what it reads comes first and by position in every caller
            return method(self, *args, **kwargs)

        return count

    # every load and store of the builder ends in these two (plain, block-pointer and descriptor ones)
    builder.create_masked_load = counting(builder.create_masked_load,
                                          lambda ptrs, mask, *_: lanes(ptrs, mask) * element_bytes(ptrs))
    builder.create_masked_store = counting(builder.create_masked_store,
                                           lambda ptrs, value, mask, *_: lanes(ptrs, mask) * element_bytes(ptrs))
    builder.create_atomic_rmw = counting(builder.create_atomic_rmw,
                                         lambda op, ptr, val, mask, *_: 2 * lanes(ptr, mask) * element_bytes(ptr))
    builder.create_atomic_cas = counting(builder.create_atomic_cas,
                                         lambda ptr, *_: 2 * ptr.data.size * element_bytes(ptr))
    builder.create_dot = _counting_dot(builder.create_dot)
    executor = interpreter.GridExecutor
    executor.__call__ = _priced(executor.__call__)


def _counting_dot(dot):
    def create_dot(self, a, b, d, *args):
        counts = _launch.counts
        if counts is not None:
            dtype = _math_dtype(a.dtype)
            # a is M x K (or B x M x K) and b K x N: 2·M·N·K
            counts.dot_flops[dtype] = counts.dot_flops.get(dtype, 0) + 2 * a.data.size * b.data.shape[-1]
        return dot(self, a, b, d, *args)

    return create_dot


def _math_dtype(ty):
    """The torch dtype whose rate (:func:`shim.clock.roofline.peak_and_efficiency`) a dot of ``ty`` inputs runs at."""
    import torch

    # any fp8 format runs at the fp8 rate; int8 and fp32 (TF32 too) dots at the fp32 figure, as eager matmuls
    return getattr(torch, "float8_e4m3fn" if ty.is_fp8() else _DOT_DTYPES.get(ty.name, "float32"))


def _priced(call):
    def __call__(self, *args, **kwargs):
        clock = RUNTIME.clock
        if clock is None or _launch.host:
            return call(self, *args, **kwargs)
        counts = _launch.counts = _Counts()
        try:
            result = call(self, *args, **kwargs)
        finally:
            _launch.counts = None
        clock.kernel(RUNTIME.device.current, self.fn.__name__, _cost(counts, clock.profile),
                     list(_emulated((*args, *kwargs.values()))))
        return result

    return __call__


def _cost(counts: _Counts, profile):
    """The roofline of a launch that did ``counts``."""
    from shim.clock.roofline import compute_seconds, kernel_cost, roofline_cost

    if not counts.dot_flops:
        return kernel_cost(None, counts.nbytes, None, profile)
    compute_s = sum(compute_seconds(flops, dtype, profile) for dtype, flops in counts.dot_flops.items())
    return roofline_cost(compute_s, sum(counts.dot_flops.values()), counts.nbytes, profile)


def _emulated(values):
    """The emulated tensors among a launch's arguments (in tuples, ``triton.reinterpret``s, descriptors)."""
    for v in values:
        if isinstance(v, tuple):
            yield from _emulated(v)
            continue
        v = getattr(v, "base", v)  # a TensorWrapper's or a TensorDescriptor's tensor
        if hasattr(v, "_gpu"):
            yield v
