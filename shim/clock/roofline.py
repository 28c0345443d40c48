"""Roofline cost of one aten op on an emulated GPU: the compute side of clocked mode (issue #16).

An op's modeled duration on the profile's GPU is

    max(flops / (peak(dtype) · compute_efficiency(dtype)), bytes / (hbm · MEMORY_EFFICIENCY)) + KERNEL_LAUNCH_S

with the FLOPs from torch's own formulas (``torch.utils.flop_counter.flop_registry``: matmuls,
convolutions) and the bytes from the sizes of the tensors the op reads and writes. An op
torch has no formula for (elementwise ops, norms, reductions, copies) costs its bytes alone and is
flagged ``has_formula=False``, so a report can count how much of a run's time is bytes-only. Views and
allocations launch no kernel and cost nothing. Attention kernels count the pairs they do not mask
and compute at a fraction of the GEMM rate of their own (``shim/clock/attention.py``).

Only tensor metadata is read (shape, stride, dtype): the function works on meta tensors and on the
shim's emulated tensors alike and computes nothing heavy. Clocked mode calls it for every op
(``shim/clock/clock.py``). docs/clocked.md ("Compute") has the figures and sources.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import MappingProxyType

import torch

from shim.clock.attention import Attention, attention, is_attention
from wire.profiles import Profile

# In a rank torch.version.hip is set (the shim reports ROCm), so importing flop_counter would log
# "triton not found" on the user's stderr: quiet that logger for the import.
_flop_log = logging.getLogger("torch.utils.flop_counter")
_flop_level = _flop_log.level
_flop_log.setLevel(logging.ERROR)
try:
    from torch.utils.flop_counter import flop_registry
finally:
    _flop_log.setLevel(_flop_level)

# AMD's published Max-Achievable FLOPs (hipBLASLt, M=4096 N=4864 K=32896; FP8 N=3648), TFLOPs, from
# the ROCm blog "Measuring Max-Achievable FLOPs – Part 2", 28 Feb 2025, rocm.blogs.amd.com/
# software-tools-optimization/measuring-max-achievable-flops-part2/README.html, Table 1. What a large
# GEMM reaches is hipBLASLt's efficiency (~94 %, same blog) times the clock the board's power limit
# sustains under dense matrix work (MI300X at 750 W: 1207 MHz for BF16; MI325X at 1000 W: 1447 MHz),
# so each GPU's own measured fraction of peak is used where AMD published one: a factor shared by the
# two left the MI300X 15 % fast on held-out torch.mm figures (docs/clocked.md, "Compute").
MEASURED_MAF_TFLOPS = MappingProxyType({
    ("AMD Instinct MI300X", "bf16"): 708.0,
    ("AMD Instinct MI300X", "fp16"): 654.0,
    ("AMD Instinct MI300X", "fp8"): 1273.0,
    ("AMD Instinct MI325X", "bf16"): 843.0,
    ("AMD Instinct MI325X", "fp16"): 794.0,
    ("AMD Instinct MI325X", "fp8"): 1519.0,
})

# For a GPU without a published figure (MI350X, MI355X): the fraction of the data-sheet peak that
# large GEMMs reach, per input dtype, the geometric mean over the MI300X and the MI325X of the
# figures above against 1307.4 and 2614.9 peak.
BF16_GEMM_EFFICIENCY = 0.59
FP16_GEMM_EFFICIENCY = 0.55
FP8_GEMM_EFFICIENCY = 0.53
# FP32 and FP64: AMD publishes no achieved GEMM figure for these GPUs that we found; BF16's factor
# stands in (unvalidated).
OTHER_COMPUTE_EFFICIENCY = BF16_GEMM_EFFICIENCY

# Fraction of the data-sheet HBM bandwidth a streaming kernel reaches. An assumption, not fitted to an
# AMD-published figure: public copy/stream measurements of the MI300X report roughly 80 % of 5.3 TB/s.
MEMORY_EFFICIENCY = 0.80

# Fixed cost per kernel (launch and ramp-up on the GPU's timeline); an assumption, a few microseconds
# as ROCm kernels typically take back to back. It dominates only tiny ops.
KERNEL_LAUNCH_S = 4e-6

_aten = torch.ops.aten
# Ops that allocate without writing: no kernel runs.
_NO_KERNEL = frozenset({
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.new_empty,
    _aten.new_empty_strided,
})
# In-place ops that overwrite ``self`` without reading it: ``self`` counts as written only.
_WRITE_ONLY_SELF = frozenset({_aten.copy_, _aten.fill_, _aten.zero_})


@dataclass(frozen=True)
class OpCost:
    """The modeled cost of one op on the emulated GPU.

    ``bound`` says which term set the time: "compute" or "memory" for an op with a FLOP formula,
    "bytes-only" for one without (its time is its bytes over the bandwidth), "free" for a view or an
    allocation, which launches no kernel (``seconds`` 0).
    """

    seconds: float
    flops: int
    bytes: int
    bound: str
    has_formula: bool

    @functools.cached_property
    def trace_args(self) -> dict:
        """The trace event's ``args`` of a kernel of this cost (shared by every such kernel: read only)."""
        return {"flops": self.flops, "bytes": self.bytes, "bound": self.bound}


def _matrix_rate(profile: Profile, kind: str, peak_tflops: float, fitted: float) -> tuple[float, float]:
    """(peak FLOP/s, fraction reached): the GPU's measured fraction where AMD published one, else ``fitted``."""
    measured = MEASURED_MAF_TFLOPS.get((profile.product, kind))
    return peak_tflops * 1e12, measured / peak_tflops if measured is not None else fitted


def peak_and_efficiency(profile: Profile, dtype: torch.dtype) -> tuple[float, float]:
    """The data-sheet peak (FLOP/s) for math in ``dtype`` on ``profile``'s GPU, and the fraction of it reached."""
    if dtype == torch.bfloat16:
        return _matrix_rate(profile, "bf16", profile.fp16_tflops, BF16_GEMM_EFFICIENCY)
    if dtype == torch.float16:
        return _matrix_rate(profile, "fp16", profile.fp16_tflops, FP16_GEMM_EFFICIENCY)
    if dtype.is_floating_point and dtype.itemsize == 1:  # the float8 family
        return _matrix_rate(profile, "fp8", profile.fp8_tflops, FP8_GEMM_EFFICIENCY)
    if dtype in (torch.float64, torch.complex128):
        return profile.fp64_tflops * 1e12, OTHER_COMPUTE_EFFICIENCY
    return profile.fp32_tflops * 1e12, OTHER_COMPUTE_EFFICIENCY


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading or writing ``t``: a broadcast (stride-0) dimension is read once."""
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def _collect(values, seen: dict[int, torch.Tensor]) -> None:
    # Depth first, left to right, as pytree flattens; aten ops nest tensors only in lists and tuples
    # (cat's list, the _foreach_ ops' lists, multi-output tuples), so a plain walk finds them all at a
    # fraction of tree_flatten's cost, which clocked mode would pay on every op.
    for v in values:
        if isinstance(v, torch.Tensor):
            seen.setdefault(id(v), v)
        elif isinstance(v, (list, tuple)):
            _collect(v, seen)


def _unique_tensors(*values) -> list[torch.Tensor]:
    """The tensors in ``values`` (nested in lists and tuples), each once, in order of first appearance."""
    # The same tensor passed twice (x + x) is read once: the second read hits the cache.
    seen: dict[int, torch.Tensor] = {}
    _collect(values, seen)
    return list(seen.values())


def _shapes(v):
    """``v`` with every tensor replaced by its shape and every list by a tuple: all a FLOP formula reads."""
    if isinstance(v, torch.Tensor):
        return v.shape
    if isinstance(v, (list, tuple)):
        return tuple(_shapes(x) for x in v)
    return v


# FLOPs by op and arguments (tensors as their shapes). torch's formulas see shapes only (flop_counter's
# wrapper maps each tensor to its shape first, with a tree_map that costs more than the rest of
# op_cost), and a training step repeats its shapes, so each count is worked out once.
_FLOPS: dict[tuple, int] = {}
_FLOPS_MAX = 4096  # a program whose shapes keep changing starts the table afresh past this


def _flops(formula, func, args, kwargs, out) -> int:
    key = (id(func), _shapes(args), _shapes(tuple(kwargs.items())), _shapes(out))  # _ops keeps func alive
    try:
        flops = _FLOPS.get(key)
    except TypeError:  # an argument that cannot be hashed: count afresh
        return int(formula(*args, **kwargs, out_val=out))
    if flops is None:
        if len(_FLOPS) >= _FLOPS_MAX:
            _FLOPS.clear()
        flops = _FLOPS[key] = int(formula(*args, **kwargs, out_val=out))
    return flops


# What op_cost needs to know of each op, worked out once and found by id (OpOverload.__hash__ is a
# Python method): the op itself (so its id stays its own), whether it launches no kernel, whether it
# only writes ``self``, its FLOP formula, and whether it is attention (priced by shim/clock/attention.py).
_OPS: dict[int, tuple] = {}


def _op(func) -> tuple:
    facts = _OPS.get(id(func))
    if facts is None:
        packet = getattr(func, "overloadpacket", func)
        free = getattr(func, "is_view", False) or packet in _NO_KERNEL
        facts = _OPS[id(func)] = (func, free, packet in _WRITE_ONLY_SELF, flop_registry.get(packet),
                                  is_attention(func))
    return facts


def is_free(func) -> bool:
    """Whether ``func`` launches no kernel (a view, an ``empty``): :func:`op_cost` prices it at nothing."""
    return _op(func)[1]


def values_matter(func) -> bool:
    """Whether :func:`op_cost` of ``func`` may read its arguments other than tensors (a FLOP formula, or
    attention's); without, it prices only the bytes of the tensors."""
    _, free, _, formula, is_attn = _op(func)
    return not free and (formula is not None or is_attn)


def op_cost(func, args, kwargs, out, profile: Profile) -> OpCost:
    """Model the time of ``func(*args, **kwargs)``, which returned ``out``, on ``profile``'s GPU.

    ``func`` is an aten OpOverload as ``__torch_dispatch__`` sees it; the tensors may be meta, CPU or
    emulated ones, only their metadata is read.
    """
    kwargs = kwargs or {}
    _, free, write_only_self, formula, is_attn = _op(func)
    if free:
        return OpCost(0.0, 0, 0, "free", False)

    reads = [v for k, v in kwargs.items() if k != "out"] if kwargs else ()  # an out= tensor is written, not read
    inputs = _unique_tensors(args, reads)
    outputs = _unique_tensors(out)
    if write_only_self and args:
        inputs = [t for t in inputs if t is not args[0]]
    if not inputs and not outputs:
        return OpCost(0.0, 0, 0, "free", False)
    nbytes = sum(tensor_bytes(t) for t in inputs) + sum(tensor_bytes(t) for t in outputs)
    if formula is None and not is_attn:
        return kernel_cost(None, nbytes, None, profile)
    # The math runs in the inputs' dtype (an fp8 GEMM writes bf16 but multiplies at the fp8 rate).
    tensors = inputs + outputs
    dtype = next((t.dtype for t in tensors if t.dtype.is_floating_point), tensors[0].dtype)
    if is_attn:
        kind = attention(func, args, kwargs)
        return kernel_cost(kind.flops, nbytes, dtype, profile, kind)
    return kernel_cost(_flops(formula, func, args, kwargs, out), nbytes, dtype, profile)


def kernel_cost(flops: int | None, nbytes: int, dtype: torch.dtype | None, profile: Profile,
                attn: Attention | None = None) -> OpCost:
    """The roofline of one kernel that moves ``nbytes`` and computes ``flops`` in ``dtype`` (None: no formula,
    its time is its bytes); an op's (:func:`op_cost`), or a kernel a compiler fused from several. An
    attention kernel (``attn``) computes at its fraction of the GEMM rate (:class:`shim.clock.attention.Attention`)."""
    if flops is None:
        return OpCost(memory_seconds(nbytes, profile) + KERNEL_LAUNCH_S, 0, nbytes, "bytes-only", False)
    compute_s = compute_seconds(flops, dtype, profile)
    if attn is not None:
        compute_s /= attn.fraction
    return roofline_cost(compute_s, flops, nbytes, profile)


def compute_seconds(flops: int, dtype: torch.dtype, profile: Profile) -> float:
    """How long ``flops`` of math in ``dtype`` take on ``profile``'s GPU, at the fraction of peak large GEMMs reach."""
    peak, efficiency = peak_and_efficiency(profile, dtype)
    return flops / (peak * efficiency)


def memory_seconds(nbytes: int, profile: Profile) -> float:
    """How long moving ``nbytes`` to or from HBM takes on ``profile``'s GPU, at the streaming fraction of peak."""
    return nbytes / (profile.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)


def roofline_cost(compute_s: float, flops: int, nbytes: int, profile: Profile) -> OpCost:
    """The roofline of a kernel whose math takes ``compute_s`` (:func:`compute_seconds`, summed over the
    dtypes it computes in) and that moves ``nbytes``: the longer of the two, plus the launch."""
    memory_s = memory_seconds(nbytes, profile)
    bound = "compute" if compute_s >= memory_s else "memory"
    return OpCost(max(compute_s, memory_s) + KERNEL_LAUNCH_S, flops, nbytes, bound, True)
