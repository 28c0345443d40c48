"""The compute cost model of clocked mode (shim/clock/roofline.py), on meta tensors: no mirage processes."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from shim.clock import roofline
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


def test_held_out_attention_is_recorded_not_within_the_goal():
    # HipKittens' attention forward on MI350X / MI355X: the model runs SDPA at the GEMM rate, and torch's
    # FLOP formula ignores is_causal, so full attention is 42-217 % fast and causal -31 to +46 %
    # (docs/clocked.md, "What it ignores"). Pinned so that a change to either shows here.
    bench = _bench()
    rows = bench.attention_rows()
    assert len(rows) == 20
    full = [r.error for r in rows if not r.published.causal]
    causal = [r.error for r in rows if r.published.causal]
    assert 0.41 < min(full) and max(full) < 2.2, full
    assert -0.32 < min(causal) and max(causal) < 0.47, causal


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
