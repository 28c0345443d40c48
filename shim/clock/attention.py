"""What an attention kernel computes, and how fast it runs next to a GEMM: clocked mode's attention (issue #30).

**FLOPs.** Per query head and sequence, attention does two matrix products over every query-key
pair it does not mask out: 2·(D_qk + D_v) FLOPs a pair forward (Q·Kᵀ and P·V), 2·(3·D_qk + 2·D_v)
backward (the scores again, dP, dV, dQ and dK: 2.5 × the forward when D_qk = D_v). These are
``torch.utils.flop_counter``'s ``sdpa_flop_count`` and ``sdpa_backward_flop_count``, but over the
pairs the kernel computes rather than all Lq·Lk of them: torch's formulas ignore ``is_causal``,
where flash and memory-efficient kernels skip the masked tiles. The pairs are counted as AMD's
AITER benchmark counts them (``valid_out_elements``, ROCm/aiter
``op_tests/op_benchmarks/triton/bench_mha.py``, commit 0925c63): a causal square pass computes
N·(N+1)/2 pairs, about half (FlashAttention's ``benchmarks/benchmark_flash_attention.py`` and
HipKittens count N²/2, N/2 pairs fewer). Causal masks are aligned as each op aligns them: SDPA's
ops and cuDNN's to the top left (query i sees keys 0..i), the raw flash op to the bottom right
(query i sees keys up to i + Lk − Lq), the raw memory-efficient op as its ``custom_mask_type``
says; the raw flash op's sliding windows are counted too. A mask given as a tensor (``attn_mask``,
``bias``) masks nothing the kernel can skip: all pairs.

Counting it here rather than with torch's formulas also fixes the raw ``_flash_attention_forward``
and ``_efficient_attention_forward`` (and their backwards) on dense (B, S, H, D) inputs, which
torch's formulas read as (B, H, S, D): H/S of the FLOPs. Variable-length batches (cumulative
sequence lengths) are priced as that many sequences of the longest length, as torch's formula does
when it cannot read the offsets: the offsets' values are not in an op's signature, by which costs
are kept (``shim/clock/op_costs.py``), so an exact count could be reused for another batch.

**Rate.** An attention kernel runs its matrix products between softmax, masking and rescaling on
the vector units and pays a fixed cost per query tile (loading Q, writing O and the log-sum-exp),
amortised over the keys each query attends. So it runs at a fraction of the GPU's large-GEMM rate
that rises with the mean number of keys per query, L, to a plateau:
``fraction(L) = A · L / (L + L0)``, fitted on AMD's AITER figures for the MI355X (forward and
backward) and checked on the MI350X's, held out (docs/clocked.md, "Attention").
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

# fraction(L) = A · L / (L + L0) of the GEMM rate (shim.clock.roofline.peak_and_efficiency), fitted
# by bench/clocked_compute.py's ``fit_attention`` on HazyResearch/HipKittens' AITER figures for the
# MI355X (bf16, D = 128, B = 16; forward: MHA H = 16 and GQA H = 64 / 8, backward: MHA), least squares
# on the log of the time. The backward's tile overhead is larger (it recomputes the scores and
# writes three gradients): its L0 is about twice the forward's.
FORWARD_PLATEAU = 0.919
FORWARD_HALF_KEYS = 515
BACKWARD_PLATEAU = 0.893
BACKWARD_HALF_KEYS = 1130


@dataclass(frozen=True)
class Attention:
    """One attention kernel: the FLOPs it computes, the mean keys each query attends, forward or backward."""

    flops: int
    keys_per_query: float
    backward: bool

    @property
    def fraction(self) -> float:
        """The fraction of the GPU's large-GEMM rate this kernel reaches."""
        if self.backward:
            plateau, half = BACKWARD_PLATEAU, BACKWARD_HALF_KEYS
        else:
            plateau, half = FORWARD_PLATEAU, FORWARD_HALF_KEYS
        keys = self.keys_per_query
        return plateau * keys / (keys + half) if keys > 0 else plateau


@dataclass(frozen=True)
class _Op:
    """How one attention op lays out its arguments."""

    backward: bool
    bshd: bool  # (batch, sequence, heads, dim), or (tokens, heads, dim) when varlen; else (batch, heads, sequence, dim)
    mask: str  # where the causal flag is: "is_causal" (top left), "flash" (bottom right), "custom" (custom_mask_type)
    cum: tuple[str, str, str, str] | None = None  # cumulative lengths and max lengths of q and k, by name


_aten = torch.ops.aten
_FLASH_CUM = ("cum_seq_q", "cum_seq_k", "max_q", "max_k")
_EFFICIENT_CUM = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_OPS = MappingProxyType({
    _aten._scaled_dot_product_flash_attention: _Op(False, False, "is_causal"),
    _aten._scaled_dot_product_flash_attention_backward: _Op(True, False, "is_causal"),
    _aten._scaled_dot_product_efficient_attention: _Op(False, False, "is_causal"),
    _aten._scaled_dot_product_efficient_attention_backward: _Op(True, False, "is_causal"),
    _aten._scaled_dot_product_cudnn_attention: _Op(False, False, "is_causal"),
    _aten._scaled_dot_product_cudnn_attention_backward: _Op(True, False, "is_causal"),
    _aten._scaled_dot_product_fused_attention_overrideable: _Op(False, False, "is_causal"),
    _aten._scaled_dot_product_fused_attention_overrideable_backward: _Op(True, False, "is_causal"),
    # what a compiled graph holds in their place (it is traced over the host tensors)
    _aten._scaled_dot_product_flash_attention_for_cpu: _Op(False, False, "is_causal"),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _Op(True, False, "is_causal"),
    _aten._flash_attention_forward: _Op(False, True, "flash", _FLASH_CUM),
    _aten._flash_attention_backward: _Op(True, True, "flash", _FLASH_CUM),
    _aten._efficient_attention_forward: _Op(False, True, "custom", _EFFICIENT_CUM),
    _aten._efficient_attention_backward: _Op(True, True, "custom", _EFFICIENT_CUM),
})


def is_attention(func) -> bool:
    """Whether ``func`` (an aten OpOverload) is an attention kernel :func:`attention` prices."""
    return getattr(func, "overloadpacket", func) in _OPS


def _bound(func, args, kwargs) -> dict:
    """``func``'s arguments by name, defaults filled in."""
    named = dict(kwargs or {})
    for arg, value in zip(func._schema.arguments, args):
        named[arg.name] = value
    for arg in func._schema.arguments:
        if arg.name not in named and arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


def _sum_clamped(first: int, count: int, top: int) -> int:
    """Σ min(max(x, 0), top) for x = first, first + 1, ..., first + count − 1."""
    last = first + count - 1
    lo, hi = max(first, 0), min(last, top)
    total = (lo + hi) * (hi - lo + 1) // 2 if lo <= hi else 0
    return total + top * max(0, last - max(first, top + 1) + 1)


def pairs(q_len: int, k_len: int, *, causal: bool, bottom_right: bool = False, left: int | None = None,
          right: int | None = None) -> int:
    """The query-key pairs an attention of ``q_len`` queries over ``k_len`` keys computes.

    ``causal``: query i sees keys j ≤ i (+ k_len − q_len aligned to the bottom right); ``left``/``right``:
    a sliding window, query i sees keys i − left ≤ j ≤ i + right (None or negative: unbounded).
    """
    right = 0 if causal else right
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    if left is None and right is None:
        return q_len * k_len
    shift = k_len - q_len if bottom_right else 0
    # keys of query i: those ≤ i + shift + right, less those < i + shift − left (a window is never empty
    # before clamping, so the difference counts the keys inside it)
    seen = q_len * k_len if right is None else _sum_clamped(shift + right + 1, q_len, k_len)
    return seen - (0 if left is None else _sum_clamped(shift - left, q_len, k_len))


def attention(func, args, kwargs) -> Attention | None:
    """The attention kernel ``func(*args, **kwargs)`` runs, or None when ``func`` is no attention op."""
    op = _OPS.get(getattr(func, "overloadpacket", func))
    if op is None:
        return None
    a = _bound(func, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    sequences = 1
    if op.bshd:
        cum_q = a.get(op.cum[0]) if op.cum else None
        if cum_q is not None:  # varlen (tokens, heads, dim): each sequence at the longest length
            sequences = cum_q.shape[0] - 1
            batch, heads, dim = sequences, q.shape[1], q.shape[2]
            q_len, k_len = int(a[op.cum[2]] or q.shape[0]), int(a[op.cum[3]] or k.shape[0])
        else:
            batch, q_len, heads, dim = q.shape
            k_len = k.shape[1]
    else:
        batch, heads, q_len, dim = q.shape
        k_len = k.shape[2]
    v_dim = v.shape[-1]
    if op.mask == "flash":
        n = pairs(q_len, k_len, causal=bool(a["is_causal"]), bottom_right=True,
                  left=a.get("window_size_left"), right=a.get("window_size_right"))
    elif op.mask == "custom":  # 0: none, 1: causal from the top left, 2: from the bottom right
        mask_type = int(a["custom_mask_type"])
        n = pairs(q_len, k_len, causal=mask_type != 0, bottom_right=mask_type == 2)
    else:
        n = pairs(q_len, k_len, causal=bool(a.get("is_causal", False)))
    per_pair = 2 * (3 * dim + 2 * v_dim) if op.backward else 2 * (dim + v_dim)
    return Attention(int(batch) * int(heads) * n * per_pair, n / q_len if q_len else 0.0, op.backward)
