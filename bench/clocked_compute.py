"""Clocked mode's compute model (shim/clock/roofline.py) against published GEMM throughput.

    python bench/clocked_compute.py

For each GPU with a published figure, prints the model's time and achieved TFLOPs for the GEMMs
AMD measured with hipBLASLt (the fit set, ``PUBLISHED``), next to AMD's figure and the error, then
the held-out set (``HELD_OUT``: ``torch.matmul`` figures from another source, another shape and
software stack, never fitted to), then large square BF16 GEMMs (model only), then memory-bound ops
whose time should follow their bytes. Then attention (shim/clock/attention.py): AITER's figures on the
MI355X the attention rate is fitted to (``ATTENTION_FIT``), and on the MI350X, held out
(``ATTENTION_HELD_OUT``). Exits 1 if a published GEMM of either set, or an attention figure at
``MIN_CLAIMED_KEYS`` keys per query or more, is off by more than MAX_ERROR (issue #30's goal). Runs
on meta tensors: nothing is computed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shim.clock.roofline import KERNEL_LAUNCH_S, OpCost, op_cost, peak_and_efficiency  # noqa: E402
from wire.profiles import load_profile  # noqa: E402

MAX_ERROR = 0.15

SOURCE = (
    "AMD, 'Measuring Max-Achievable FLOPs - Part 2', ROCm blog, 28 Feb 2025, Table 1 "
    "(rocm.blogs.amd.com/software-tools-optimization/measuring-max-achievable-flops-part2/README.html)"
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fnuz}


@dataclass(frozen=True)
class Published:
    """One achieved GEMM throughput AMD published: hipblaslt-bench, M×N×K, NN, cold caches."""

    profile: str
    dtype: str
    m: int
    n: int
    k: int
    tflops: float


# Table 1 of SOURCE; the sizes are its Appendix B's hipblaslt-bench command lines. The fit set.
PUBLISHED = (
    Published("mi300x", "bf16", 4096, 4864, 32896, 708.0),
    Published("mi300x", "fp16", 4096, 4864, 32896, 654.0),
    Published("mi300x", "fp8", 4096, 3648, 32896, 1273.0),
    Published("mi325x", "bf16", 4096, 4864, 32896, 843.0),
    Published("mi325x", "fp16", 4096, 4864, 32896, 794.0),
    Published("mi325x", "fp8", 4096, 3648, 32896, 1519.0),
)

HELD_OUT_SOURCE = (
    "S. Bekman, 'Machine Learning Engineering', compute/accelerator/README.md, 'Maximum Achievable "
    "Matmul FLOPS comparison table', BF16 (github.com/stas00/ml-engineering, commit 744d01e): torch.mm "
    "via mamf-finder.py, mean of 100 runs after 50 warm-up, best shape of a search"
)

# The held-out set: chosen before the model's error on it was computed, never fitted to. Each row is
# the table's MAMF at its best shape (MxNxK as the table prints it); MI300X on torch 2.5.1 + ROCm 6.3
# with TunableOp, MI325X (1000 W) on torch 2.6.0 + ROCm 6.2.4 with TunableOp, MI355X on torch 2.8.0 +
# ROCm 7.0.2 without. The table lists the MI355X's peak as 2300 TFLOPs; the profile's data-sheet
# figure is 2500 (the model's peak is the profile's).
HELD_OUT = (
    Published("mi300x", "bf16", 10240, 15360, 8192, 668.4),
    Published("mi325x", "bf16", 13312, 10240, 8192, 784.9),
    Published("mi355x", "bf16", 12288, 8192, 8192, 1565.0),
    # HazyResearch/HipKittens analysis/mi350x_data_to_log.json (commit 978e0c5), "tflops_pytorch":
    # torch.matmul in bf16, M = N = K, on an MI350X. Its 1024 and 2048 rows (81.8, 372.9 TFLOPs)
    # are launch-bound, outside what the roofline claims (docs/clocked.md, "What it ignores").
    Published("mi350x", "bf16", 4096, 4096, 4096, 1037.8),
    Published("mi350x", "bf16", 8192, 8192, 8192, 1116.7),
    Published("mi350x", "bf16", 16384, 16384, 16384, 1039.9),
)

ATTENTION_SOURCE = (
    "HazyResearch/HipKittens, AMD's AITER (aiter.flash_attn_func) as its baseline, BF16, B=16, D=128, "
    "MHA H=16 and GQA H=64 / H_KV=8; MI355X: analysis/attn/fwd/benchmark/mi355x_{mha,gqa}_{causal,non_causal}_fwd.json "
    "and analysis/attn/bkwd/benchmark/mi355x_mha_bkwd_{causal,non_causal}.json, 'tflops_ref' (commit f09e968); "
    "MI350X: analysis/attn/fwd/plot.py, 'aiter' (commit 7bd6c82). TFLOPs count 4·B·H·N²·D a pass, half of it "
    "causal, 2.5 times it backward (the repository's test_python.py)"
)


@dataclass(frozen=True)
class PublishedAttention:
    """One published AITER attention throughput: bf16, D=128, ``batch`` × ``heads`` (``kv_heads`` for K and V)."""

    profile: str
    heads: int
    kv_heads: int
    causal: bool
    n: int
    tflops: float
    backward: bool = False
    batch: int = 16

    @property
    def seconds(self) -> float:
        """The published time: the source's FLOP count (4·B·H·N²·D, half causal, 2.5× backward) over its TFLOPs."""
        flops = 4 * self.batch * self.heads * self.n**2 * 128 / (2 if self.causal else 1) * (2.5 if self.backward else 1)
        return flops / (self.tflops * 1e12)


_N = (1024, 2048, 4096, 8192, 16384)


def _series(profile: str, heads: int, kv_heads: int, causal: bool, tflops, backward: bool = False,
            last_batch: int = 16) -> tuple[PublishedAttention, ...]:
    batches = (16, 16, 16, 16, last_batch)
    return tuple(PublishedAttention(profile, heads, kv_heads, causal, n, t, backward, b)
                 for n, t, b in zip(_N, tflops, batches))


# The fit set of the attention rate (shim/clock/attention.py): AITER on the MI355X. Its forward at
# N = 16384 ran with B = 15 (the repository's mi355x_benchmark.sh). Left out: its GQA backward, where
# AITER (150-390 TFLOPs) and Composable Kernel (~370) reach a third of their own MHA backward.
ATTENTION_FIT = (
    _series("mi355x", 16, 16, False, (828.13, 1085.17, 1210.71, 1259.30, 1282.61), last_batch=15)
    + _series("mi355x", 16, 16, True, (554.63, 876.33, 1069.02, 1173.23, 1247.43), last_batch=15)
    + _series("mi355x", 64, 8, False, (1032.5, 1152.4, 1231.2, 1281.3, 1291.3), last_batch=15)
    + _series("mi355x", 64, 8, True, (715.1, 941.1, 1100.9, 1204.7, 1246.1), last_batch=15)
    + _series("mi355x", 16, 16, False, (589.7, 867.6, 1056.0, 1166.8, 1201.2), backward=True)
    + _series("mi355x", 16, 16, True, (388.7, 673.1, 876.8, 1034.1, 1108.7), backward=True)
)

# Held out, never fitted to: AITER's forward on the MI350X (its only published attention figures).
ATTENTION_HELD_OUT = (
    _series("mi350x", 16, 16, False, (392.17, 698.19, 953.31, 909.30, 952.64))
    + _series("mi350x", 16, 16, True, (570.79, 896.85, 976.44, 956.59, 974.80))
    + _series("mi350x", 64, 8, False, (567.01, 782.79, 844.96, 915.63, 968.90))
    + _series("mi350x", 64, 8, True, (818.35, 967.91, 968.28, 983.25, 1009.18))
)

#: below this many keys per query the model does not claim the goal (the per-tile cost dominates)
MIN_CLAIMED_KEYS = 1024

#: each GPU's measured large BF16 GEMM rate among the held-out GEMM figures (TFLOPs): what the
#: attention rows would be off by were the model's GEMM rate that one
MEASURED_GEMM_TFLOPS = {"mi350x": 1116.7, "mi355x": 1565.0}


@dataclass(frozen=True)
class GemmRow:
    """The model against one published figure."""

    published: Published
    cost: OpCost

    @property
    def model_tflops(self) -> float:
        """The throughput the model gives this GEMM."""
        return self.cost.flops / self.cost.seconds / 1e12

    @property
    def error(self) -> float:
        """(model − published) / published, on throughput."""
        return self.model_tflops / self.published.tflops - 1


def gemm_cost(profile: str, dtype: torch.dtype, m: int, n: int, k: int) -> OpCost:
    """The model's cost of an M×K by K×N ``aten.mm`` in ``dtype`` on ``profile``'s GPU."""
    a = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(k, n, dtype=dtype, device="meta")
    return op_cost(torch.ops.aten.mm.default, (a, b), {}, torch.mm(a, b), load_profile(profile))


def fitted_efficiency(dtype: str) -> float:
    """The compute efficiency the published figures give ``dtype``: the geometric mean of achieved / peak."""
    ratios = []
    for p in PUBLISHED:
        if p.dtype == dtype:
            peak, _ = peak_and_efficiency(load_profile(p.profile), _DTYPES[dtype])
            ratios.append(p.tflops * 1e12 / peak)
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def gemm_rows(published: tuple[Published, ...] = PUBLISHED) -> list[GemmRow]:
    """The model against every figure of ``published`` (the fit set by default, or ``HELD_OUT``)."""
    return [GemmRow(p, gemm_cost(p.profile, _DTYPES[p.dtype], p.m, p.n, p.k)) for p in published]


@dataclass(frozen=True)
class AttentionRow:
    """The model against one published attention figure."""

    published: PublishedAttention
    cost: OpCost

    @property
    def error(self) -> float:
        """(model − published) / published, on throughput: the published time over the model's, less 1."""
        return self.published.seconds / self.cost.seconds - 1

    @property
    def keys_per_query(self) -> float:
        """The mean keys a query attends: N, or (N + 1) / 2 causal."""
        return (self.published.n + 1) / 2 if self.published.causal else self.published.n

    @property
    def claimed(self) -> bool:
        """Whether the goal applies: enough keys per query for the plateau model."""
        return self.keys_per_query >= MIN_CLAIMED_KEYS

    @property
    def error_at_measured_gemm(self) -> float | None:
        """The error were the model's BF16 GEMM rate the GPU's measured one (None: none measured)."""
        measured = MEASURED_GEMM_TFLOPS.get(self.published.profile)
        if measured is None:
            return None
        peak, efficiency = peak_and_efficiency(load_profile(self.published.profile), torch.bfloat16)
        launch = KERNEL_LAUNCH_S
        return self.published.seconds / ((self.cost.seconds - launch) * peak * efficiency / (measured * 1e12) + launch) - 1


def attention_cost(p: PublishedAttention) -> OpCost:
    """The model's cost of SDPA's flash-attention kernel (forward or backward) at ``p``'s shape, bf16."""
    q = torch.empty(p.batch, p.heads, p.n, 128, dtype=torch.bfloat16, device="meta")
    k, v = (torch.empty(p.batch, p.kv_heads, p.n, 128, dtype=torch.bfloat16, device="meta") for _ in range(2))
    forward = torch.ops.aten._scaled_dot_product_flash_attention.default
    args = (q, k, v, 0.0, p.causal)
    out = forward(*args)
    if not p.backward:
        return op_cost(forward, args, {}, out, load_profile(p.profile))
    backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    args = (q, q, k, v, out[0], out[1], None, None, p.n, p.n, 0.0, p.causal, out[6], out[7])
    return op_cost(backward, args, {}, backward(*args), load_profile(p.profile))


def attention_rows(published: tuple[PublishedAttention, ...] = ATTENTION_HELD_OUT) -> list[AttentionRow]:
    """The model against every figure of ``published`` (the held-out set by default, or ``ATTENTION_FIT``)."""
    return [AttentionRow(p, attention_cost(p)) for p in published]


def fit_attention(backward: bool) -> tuple[float, int]:
    """(plateau, half keys) of ``fraction(L) = plateau · L / (L + half)`` fitted on ``ATTENTION_FIT``'s forward or
    backward rows: least squares on the log of the time, half on a grid of 5 keys (shim/clock/attention.py)."""
    rows = []  # (the fraction of the model's GEMM rate each row reached, its keys per query)
    for r in attention_rows(ATTENTION_FIT):
        if r.published.backward == backward:
            peak, efficiency = peak_and_efficiency(load_profile(r.published.profile), torch.bfloat16)
            gemm_s = r.cost.flops / (peak * efficiency)  # the model's FLOPs at the GEMM rate, less the launch
            rows.append((gemm_s / (r.published.seconds - KERNEL_LAUNCH_S), r.keys_per_query))
    best = None
    for half in range(50, 4000, 5):
        logs = [math.log(reached * (keys + half) / keys) for reached, keys in rows]
        mean = sum(logs) / len(logs)
        residual = sum((x - mean) ** 2 for x in logs)
        if best is None or residual < best[0]:
            best = (residual, math.exp(mean), half)
    return best[1], best[2]


def _print_attention(rows: list[AttentionRow]) -> None:
    print(f"{'GPU':7s} {'pass':4s} {'heads':>5s} {'mask':6s} {'N':>6s} {'model ms':>9s} {'pub. ms':>8s} {'pub. TF':>7s} "
          f"{'error':>7s} {'at meas. GEMM':>13s}")
    for r in rows:
        p = r.published
        measured = r.error_at_measured_gemm
        print(f"{p.profile:7s} {'bwd' if p.backward else 'fwd':4s} {f'{p.heads}/{p.kv_heads}':>5s} "
              f"{'causal' if p.causal else 'full':6s} {p.n:6d} {r.cost.seconds * 1e3:9.3f} {p.seconds * 1e3:8.3f} "
              f"{p.tflops:7.1f} {r.error:+7.1%} {'' if measured is None else f'{measured:+.1%}':>13s}"
              f"{'' if r.claimed else '  (not claimed)'}")


def _print_gemms(rows: list[GemmRow]) -> None:
    print(f"{'GPU':7s} {'dtype':5s} {'M×N×K':>20s} {'model ms':>9s} {'model TF':>9s} {'pub. TF':>7s} {'error':>7s}")
    for r in rows:
        p = r.published
        print(f"{p.profile:7s} {p.dtype:5s} {f'{p.m}×{p.n}×{p.k}':>20s} {r.cost.seconds * 1e3:9.3f} "
              f"{r.model_tflops:9.1f} {p.tflops:7.1f} {r.error:+7.1%}")


def _memory_rows(profile: str) -> list[tuple[str, OpCost]]:
    prof = load_profile(profile)
    rows = []
    for n in (1 << 24, 1 << 26, 1 << 28):
        x = torch.empty(n, dtype=torch.bfloat16, device="meta")
        y = torch.empty(n, dtype=torch.bfloat16, device="meta")
        rows.append((f"add bf16 [{n}]", op_cost(torch.ops.aten.add.Tensor, (x, y), {}, x + y, prof)))
    hidden = 8192
    w = torch.empty(hidden, dtype=torch.bfloat16, device="meta")
    for tokens in (4096, 16384, 65536):
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
        args = (x, [hidden], w, w, 1e-5)
        out = torch.ops.aten.native_layer_norm.default(*args)
        rows.append((f"layer_norm bf16 [{tokens}, {hidden}]", op_cost(torch.ops.aten.native_layer_norm.default,
                                                                      args, {}, out, prof)))
    return rows


def main() -> int:
    """Print the tables; 1 if a published GEMM is off by more than MAX_ERROR."""
    rows = gemm_rows()
    print(f"Fit set: {SOURCE}\n")
    _print_gemms(rows)
    held = gemm_rows(HELD_OUT)
    print(f"\nHeld-out set: {HELD_OUT_SOURCE}; MI350X rows from HazyResearch/HipKittens\n")
    _print_gemms(held)
    fit_attn, attention = attention_rows(ATTENTION_FIT), attention_rows()
    print(f"\nAttention: {ATTENTION_SOURCE}\n\nFit set (MI355X):\n")
    _print_attention(fit_attn)
    print("\nHeld out (MI350X):\n")
    _print_attention(attention)
    for backward in (False, True):
        plateau, half = fit_attention(backward)
        print(f"attention {'backward' if backward else 'forward'} fitted: fraction of the GEMM rate "
              f"{plateau:.3f} · L / (L + {half})")
    print("\nefficiency fitted from the figures (geometric mean of achieved/peak): "
          + ", ".join(f"{d} {fitted_efficiency(d):.3f}" for d in _DTYPES))

    print(f"\n{'GPU':7s} {'bf16 GEMM (model only)':>22s} {'ms':>9s} {'TF':>9s}")
    for profile in sorted({p.profile for p in PUBLISHED + HELD_OUT}):
        for s in (8192, 16384):
            c = gemm_cost(profile, torch.bfloat16, s, s, s)
            print(f"{profile:7s} {f'{s}³':>22s} {c.seconds * 1e3:9.3f} {c.flops / c.seconds / 1e12:9.1f}")

    print(f"\nmemory-bound ops on mi300x (time less the {KERNEL_LAUNCH_S * 1e6:.0f} µs launch, per byte):")
    print(f"{'op':30s} {'MB':>9s} {'µs':>9s} {'GB/s':>7s} {'bound':>10s}")
    for name, c in _memory_rows("mi300x"):
        gbps = c.bytes / (c.seconds - KERNEL_LAUNCH_S) / 1e9
        print(f"{name:30s} {c.bytes / 1e6:9.1f} {c.seconds * 1e6:9.1f} {gbps:7.0f} {c.bound:>10s}")

    worst = max(rows, key=lambda r: abs(r.error))
    worst_held = max(held, key=lambda r: abs(r.error))
    claimed = [r for r in fit_attn + attention if r.claimed]
    worst_fit_attention = max((r for r in fit_attn if r.claimed), key=lambda r: abs(r.error))
    worst_attention = max((r for r in attention if r.claimed), key=lambda r: abs(r.error))
    print(f"\nworst GEMM error: fit set {worst.error:+.1%} ({worst.published.profile} {worst.published.dtype}), "
          f"held out {worst_held.error:+.1%} ({worst_held.published.profile} {worst_held.published.dtype}); "
          f"worst attention error at L >= {MIN_CLAIMED_KEYS}: fit set {worst_fit_attention.error:+.1%}, held out "
          f"{worst_attention.error:+.1%} ({_describe(worst_attention.published)}); target ±{MAX_ERROR:.0%}")
    worst_all = max(abs(worst.error), abs(worst_held.error), *(abs(r.error) for r in claimed))
    return 1 if worst_all > MAX_ERROR else 0


def _describe(p: PublishedAttention) -> str:
    return (f"{p.profile} {'bwd' if p.backward else 'fwd'} {p.heads}/{p.kv_heads} heads "
            f"{'causal' if p.causal else 'full'} {p.n}")


if __name__ == "__main__":
    sys.exit(main())
