"""The compute cost model of clocked mode (shim/clock/roofline.py), on meta tensors: no mirage processes."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from shim.clock import attention, roofline
from shim.clock.roofline import op_cost
from wire.profiles import load_profile

REPO_ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
MI300X = load_profile("mi300x")
MI350X = load_profile("mi350x")  # no published achieved figure: the fitted factors apply


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def mm_cost(m, n, k, dtype=torch.bfloat16, profile=MI300X):
    a, b = meta(m, k, dtype=dtype), meta(k, n, dtype=dtype)
    return op_cost(aten.mm.default, (a, b), {}, torch.mm(a, b), profile)


def compute_seconds(flops, tflops, efficiency):
    return flops / (tflops * 1e12 * efficiency) + roofline.KERNEL_LAUNCH_S


def test_matmul_is_2mnk_flops_at_the_modeled_bf16_efficiency():
    m, n, k = 8192, 4096, 16384
    c = mm_cost(m, n, k, profile=MI350X)
    assert c.flops == 2 * m * n * k
    assert c.bytes == (m * k + k * n + m * n) * 2
    assert (c.bound, c.has_formula) == ("compute", True)
    assert c.seconds == pytest.approx(compute_seconds(c.flops, MI350X.fp16_tflops, roofline.BF16_GEMM_EFFICIENCY))


@pytest.mark.parametrize("dtype, kind", [(torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                         (torch.float8_e4m3fnuz, "fp8")])
@pytest.mark.parametrize("name", ["mi300x", "mi325x"])
def test_a_gpu_with_a_published_max_achievable_figure_runs_large_gemms_at_it(name, dtype, kind):
    profile = load_profile(name)
    c = mm_cost(8192, 8192, 8192, dtype=dtype, profile=profile)
    achieved = roofline.MEASURED_MAF_TFLOPS[(profile.product, kind)] * 1e12
    assert c.seconds == pytest.approx(c.flops / achieved + roofline.KERNEL_LAUNCH_S)


def test_a_skinny_matmul_is_memory_bound():
    c = mm_cost(8192, 1, 8192)  # a matrix-vector product: 2 FLOPs per weight read
    assert c.bound == "memory"
    bandwidth = MI300X.hbm_tbps * 1e12 * roofline.MEMORY_EFFICIENCY
    assert c.seconds == pytest.approx(c.bytes / bandwidth + roofline.KERNEL_LAUNCH_S)


def test_convolution_uses_torchs_formula():
    x, w = meta(8, 64, 56, 56), meta(128, 64, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    out = aten.convolution.default(*args)
    c = op_cost(aten.convolution.default, args, {}, out, MI300X)
    # 2 FLOPs per multiply-add: every output element sums C_in · kh · kw products
    assert c.flops == 2 * out.numel() * 64 * 3 * 3
    assert c.has_formula


def test_flop_counts_are_kept_per_shapes_and_arguments():
    """A count is worked out once per op, shapes and other arguments: a change in any of them counts afresh."""
    roofline._FLOPS.clear()
    assert mm_cost(64, 32, 16).flops == 2 * 64 * 32 * 16
    assert mm_cost(64, 32, 16).flops == 2 * 64 * 32 * 16 and len(roofline._FLOPS) == 1
    assert mm_cost(64, 32, 8).flops == 2 * 64 * 32 * 8
    x, w = meta(1, 8, 16, 16), meta(8, 8, 3, 3)
    for stride in (1, 2):
        args = (x, w, None, [stride, stride], [1, 1], [1, 1], False, [0, 0], 1)
        out = aten.convolution.default(*args)
        assert op_cost(aten.convolution.default, args, {}, out, MI300X).flops == 2 * out.numel() * 8 * 3 * 3
    assert len(roofline._FLOPS) == 4


def test_elementwise_costs_its_bytes_and_doubles_with_them():
    def add(n):
        x, y = meta(n), meta(n)
        return op_cost(aten.add.Tensor, (x, y), {}, x + y, MI300X)

    small, large = add(1 << 26), add(1 << 27)
    assert small.bytes == 3 * (1 << 26) * 2  # two reads, one write
    assert (small.bound, small.has_formula, small.flops) == ("bytes-only", False, 0)
    launch = roofline.KERNEL_LAUNCH_S
    assert large.seconds - launch == pytest.approx(2 * (small.seconds - launch))


def test_an_op_without_a_formula_is_flagged_bytes_only():
    x = meta(4096, 4096)
    out = torch.sort(x, dim=-1)
    c = op_cost(aten.sort.default, (x, -1), {}, tuple(out), MI300X)
    assert (c.has_formula, c.bound, c.flops) == (False, "bytes-only", 0)
    assert c.bytes == 4096 * 4096 * (2 + 2 + 8)  # bf16 in, bf16 values and int64 indices out


def test_views_and_allocations_are_free():
    x = meta(64, 64)
    for func, args in ((aten.t.default, (x,)), (aten.view.default, (x, [4096])), (aten.empty_like.default, (x,))):
        c = op_cost(func, args, {}, func(*args), MI300X)
        assert (c.seconds, c.bound) == (0.0, "free")


def test_same_tensor_twice_is_read_once_and_in_place_reads_and_writes():
    x = meta(1 << 20)
    assert op_cost(aten.add.Tensor, (x, x), {}, x + x, MI300X).bytes == 2 * x.nbytes
    y = meta(1 << 20)
    assert op_cost(aten.add_.Tensor, (x, y), {}, x, MI300X).bytes == 3 * x.nbytes
    assert op_cost(aten.copy_.default, (x, y), {}, x, MI300X).bytes == 2 * x.nbytes


def test_a_broadcast_operand_is_read_once():
    row = meta(4096).expand(1024, 4096)
    x = meta(1024, 4096)
    c = op_cost(aten.mul.Tensor, (x, row), {}, x * row, MI300X)
    assert c.bytes == (2 * 1024 * 4096 + 4096) * 2


@pytest.mark.parametrize(
    "dtype, field, efficiency",
    [
        (torch.float8_e4m3fn, "fp8_tflops", roofline.FP8_GEMM_EFFICIENCY),
        (torch.float16, "fp16_tflops", roofline.FP16_GEMM_EFFICIENCY),
        (torch.float32, "fp32_tflops", roofline.OTHER_COMPUTE_EFFICIENCY),
        (torch.float64, "fp64_tflops", roofline.OTHER_COMPUTE_EFFICIENCY),
    ],
)
def test_each_dtype_uses_its_peak(dtype, field, efficiency):
    c = mm_cost(8192, 8192, 8192, dtype=dtype, profile=MI350X)
    assert c.bound == "compute"
    assert c.seconds == pytest.approx(compute_seconds(c.flops, getattr(MI350X, field), efficiency))


def test_a_scaled_fp8_gemm_runs_at_the_fp8_rate_though_it_writes_bf16():
    a, b = meta(8192, 8192, dtype=torch.float8_e4m3fn), meta(8192, 8192, dtype=torch.float8_e4m3fn).t()
    scale = meta((), dtype=torch.float32)
    args = (a, b, scale, scale, None, None, torch.bfloat16)  # as __torch_dispatch__ passes them
    out = aten._scaled_mm.default(*args)
    assert out.dtype == torch.bfloat16
    c = op_cost(aten._scaled_mm.default, args, {}, out, MI350X)
    assert c.flops == 2 * 8192**3
    assert c.seconds == pytest.approx(compute_seconds(c.flops, MI350X.fp8_tflops, roofline.FP8_GEMM_EFFICIENCY))


def test_a_faster_gpu_is_faster():
    assert mm_cost(8192, 8192, 8192, profile=load_profile("mi355x")).seconds < mm_cost(8192, 8192, 8192).seconds


def _bench():
    spec = importlib.util.spec_from_file_location("clocked_compute", REPO_ROOT / "bench" / "clocked_compute.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_the_model_meets_amds_published_gemm_throughput():
    bench = _bench()
    rows = bench.gemm_rows()
    assert {r.published.profile for r in rows} == {"mi300x", "mi325x"}
    for r in rows:
        assert abs(r.error) <= bench.MAX_ERROR, (r.published, r.model_tflops)


def test_the_model_meets_held_out_torch_matmul_throughput():
    # stas00/ml-engineering's MAMF table (torch.mm, another shape and software stack), never fitted to:
    # within issue #30's 15 % on every GPU it lists (MI300X +5.8 %, MI325X +7.2 %, MI355X -6.1 %).
    bench = _bench()
    rows = [r for r in bench.gemm_rows(bench.HELD_OUT) if r.published.profile != "mi350x"]
    assert {r.published.profile for r in rows} == {"mi300x", "mi325x", "mi355x"}
    for r in rows:
        assert abs(r.error) <= bench.MAX_ERROR, (r.published, r.model_tflops)


def test_the_mi350x_misses_held_out_torch_matmul_by_its_recorded_error():
    # HipKittens' torch.matmul on an MI350X (1000 W) reaches 45-49 % of peak, where the factor fitted on
    # CDNA3 gives 59 %: +20.9 to +30.4 %, over the goal (docs/clocked.md). A larger miss fails here.
    bench = _bench()
    rows = [r for r in bench.gemm_rows(bench.HELD_OUT) if r.published.profile == "mi350x"]
    assert len(rows) == 3
    for r in rows:
        assert 0.15 < r.error <= 0.31, (r.published, r.error)


def _sdpa(n, causal, *, heads=16, kv_heads=16, batch=16, dim=128, backward=False):
    """SDPA's flash kernel (forward, or its backward) at ``n`` positions, bf16: (op, args, out)."""
    q = meta(batch, heads, n, dim)
    k, v = meta(batch, kv_heads, n, dim), meta(batch, kv_heads, n, dim)
    forward = aten._scaled_dot_product_flash_attention.default
    out = forward(q, k, v, 0.0, causal)
    if not backward:
        return forward, (q, k, v, 0.0, causal), out
    op = aten._scaled_dot_product_flash_attention_backward.default
    args = (q, q, k, v, out[0], out[1], None, None, n, n, 0.0, causal, out[6], out[7])
    return op, args, op(*args)


def test_causal_attention_is_charged_the_pairs_it_computes():
    # torch's formula charges all N² pairs whatever is_causal says; the kernels skip the masked ones:
    # N·(N + 1) / 2 pairs (AITER's count), 2·(D + D) FLOPs a pair forward, 2·(3·D + 2·D) backward
    b, h, n, d = 2, 4, 1024, 64
    for causal, pairs in ((False, n * n), (True, n * (n + 1) // 2)):
        for backward, per_pair in ((False, 4 * d), (True, 10 * d)):
            func, args, out = _sdpa(n, causal, heads=h, kv_heads=h, batch=b, dim=d, backward=backward)
            assert op_cost(func, args, {}, out, MI300X).flops == b * h * pairs * per_pair, (causal, backward)
    # memory-efficient SDPA (a float32 or masked pass) the same way
    q = meta(b, h, n, d)
    efficient = aten._scaled_dot_product_efficient_attention.default
    out = efficient(q, q, q, None, False, 0.0, True)
    assert op_cost(efficient, (q, q, q, None, False, 0.0, True), {}, out, MI300X).flops == b * h * n * (n + 1) // 2 * 4 * d


def test_the_raw_attention_ops_are_counted_in_their_own_layout():
    # _flash_attention_forward takes (batch, sequence, heads, dim); torch's formula reads it as (batch, heads,
    # sequence, dim), which charged it heads / sequence of its FLOPs
    b, n, h, d = 2, 512, 8, 64
    q = meta(b, n, h, d)
    flash = aten._flash_attention_forward.default
    assert attention.attention(flash, (q, q, q, None, None, n, n, 0.0, False, False), {}).flops == 4 * b * h * n * n * d
    causal = attention.attention(flash, (q, q, q, None, None, n, n, 0.0, True, False), {})
    assert causal.flops == 4 * b * h * d * n * (n + 1) // 2 and causal.keys_per_query == (n + 1) / 2
    # a sliding window of 128 keys to the left: each query sees itself and up to 128 keys before it
    window = attention.attention(flash, (q, q, q, None, None, n, n, 0.0, True, False),
                                 {"window_size_left": 128, "window_size_right": 0})
    assert window.flops == 4 * b * h * d * sum(min(i, 128) + 1 for i in range(n))
    efficient = aten._efficient_attention_forward.default  # custom_mask_type 1: causal from the top left
    assert attention.attention(efficient, (q, q, q, None, None, None, n, n, 0.0, 1), {}).flops == causal.flops


def test_pairs_follow_each_mask_alignment():
    assert attention.pairs(4, 6, causal=True) == 1 + 2 + 3 + 4  # SDPA: query i sees keys 0..i
    assert attention.pairs(4, 6, causal=True, bottom_right=True) == 3 + 4 + 5 + 6  # flash: keys 0..i + 2
    assert attention.pairs(6, 4, causal=True) == 1 + 2 + 3 + 4 + 4 + 4
    assert attention.pairs(8, 8, causal=False, left=2, right=1) == 2 + 3 + 4 * 5 + 3
    assert attention.pairs(8, 8, causal=False) == 64


def test_attention_runs_at_a_fraction_of_the_gemm_rate_rising_with_its_keys():
    # fraction(L) = 0.919 · L / (L + 515) forward, 0.893 · L / (L + 1130) backward, of the GEMM rate
    mi355x = load_profile("mi355x")
    peak, efficiency = roofline.peak_and_efficiency(mi355x, torch.bfloat16)
    for n, causal, backward in ((4096, False, False), (4096, True, False), (16384, False, False), (4096, False, True)):
        func, args, out = _sdpa(n, causal, backward=backward)
        cost = op_cost(func, args, {}, out, mi355x)
        keys = (n + 1) / 2 if causal else n
        plateau, half = (0.893, 1130) if backward else (0.919, 515)
        expected = cost.flops / (peak * efficiency * plateau * keys / (keys + half)) + roofline.KERNEL_LAUNCH_S
        assert cost.seconds == pytest.approx(expected, rel=1e-12), (n, causal, backward)
    # so an attention pass is slower than a GEMM of the same FLOPs, and less so with more keys
    fraction = [attention.Attention(1, keys, False).fraction for keys in (512, 2048, 16384)]
    assert fraction == sorted(fraction) and fraction[-1] < 0.919


def test_the_attention_constants_are_the_fit_of_the_mi355x_figures():
    bench = _bench()
    assert bench.fit_attention(backward=False) == (pytest.approx(attention.FORWARD_PLATEAU, abs=5e-4),
                                                   attention.FORWARD_HALF_KEYS)
    assert bench.fit_attention(backward=True) == (pytest.approx(attention.BACKWARD_PLATEAU, abs=5e-4),
                                                  attention.BACKWARD_HALF_KEYS)


def test_the_attention_model_meets_its_fit_set_where_it_claims_to():
    # AITER on the MI355X, forward (MHA and GQA) and backward (MHA): within 15 % at 1024 keys per query or
    # more (worst -13.2 %, GQA full 1024); below that (causal 1024) up to +17.2 %, not claimed
    bench = _bench()
    rows = bench.attention_rows(bench.ATTENTION_FIT)
    assert len(rows) == 30 and sum(not r.claimed for r in rows) == 3
    for r in rows:
        assert abs(r.error) <= (bench.MAX_ERROR if r.claimed else 0.18), (r.published, r.error)


def test_held_out_mi350x_attention_is_recorded():
    # AITER on the MI350X, held out: at 1024 keys or more -14.6 to +106.6 %, worst at full N = 1024 (where
    # AITER's full pass took 2.9 times its causal one, which computes half the pairs); full attention +16 to
    # +31 % from N = 4096 on, the MI350X's GEMM rate being 21-30 % fast (the model's MI350X GEMMs): at its
    # measured torch.matmul rate those rows are -4.5 to +7.8 %. Pinned so that a change to either shows here
    # (docs/clocked.md, "Attention").
    bench = _bench()
    rows = [r for r in bench.attention_rows() if r.claimed]
    assert len(rows) == 18
    errors = [r.error for r in rows]
    assert -0.15 < min(errors) and max(errors) < 1.07, errors
    plateau = [r for r in rows if not r.published.causal and r.published.n >= 4096]
    assert all(0.15 < r.error < 0.32 and abs(r.error_at_measured_gemm) < 0.08 for r in plateau), plateau


def test_the_measured_figures_are_amds_published_ones():
    bench = _bench()
    assert {(load_profile(p.profile).product, p.dtype): p.tflops for p in bench.PUBLISHED} == dict(roofline.MEASURED_MAF_TFLOPS)
    # the MI355X has no published figure: its held-out row checks the fitted factor, not a measurement
    assert (load_profile("mi355x").product, "bf16") not in roofline.MEASURED_MAF_TFLOPS


def test_the_efficiency_constants_are_the_fit_of_the_published_figures():
    bench = _bench()
    for dtype, constant in (("bf16", roofline.BF16_GEMM_EFFICIENCY), ("fp16", roofline.FP16_GEMM_EFFICIENCY),
                            ("fp8", roofline.FP8_GEMM_EFFICIENCY)):
        assert round(bench.fitted_efficiency(dtype), 2) == constant
