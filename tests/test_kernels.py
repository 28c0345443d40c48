"""The numpy reduction kernels, dtype by dtype, against plain numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from daemon_client import bf16_bits, bf16_to_f32

from wire import kernels
from wire.kernels import KernelError, itemsize, reduce, typed
from wire.schema import ReduceOp

R = ReduceOp
ALL_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]


def parts_of(dtype, n=257, world=3, seed=0):
    rng = np.random.default_rng(seed)
    if dtype in ("int32", "int64", "int8", "int16"):
        return [rng.integers(-9, 10, n).astype(dtype) for _ in range(world)]
    if dtype == "uint8":
        return [rng.integers(0, 6, n).astype(dtype) for _ in range(world)]
    return [(rng.standard_normal(n) * 4).astype(dtype) for _ in range(world)]


def reference(parts, op):
    """Sequential left-to-right reduction in the parts' own dtype (as the kernels do)."""
    fn = {R.SUM: np.add, R.AVG: np.add, R.PRODUCT: np.multiply, R.MIN: np.minimum, R.MAX: np.maximum}[op]
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = fn(acc, p)
    if op is R.AVG:
        acc = acc / len(parts)
    return acc.astype(parts[0].dtype)


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_float_reductions(dtype, op, world):
    parts = parts_of(dtype, world=world, seed=world)
    got = reduce(parts, op, dtype)
    assert got.dtype == np.dtype(dtype) and got.shape == parts[0].shape
    np.testing.assert_array_equal(got, reference(parts, op))
    # and close to a float64 reduction
    wide = [p.astype(np.float64) for p in parts]
    want = reference(wide, op)
    tol = {"float16": 4e-3, "float32": 1e-6, "float64": 1e-14}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 20)


def test_reduce_does_not_touch_inputs():
    parts = parts_of("float32")
    before = [p.copy() for p in parts]
    out = reduce(parts, R.SUM, "float32")
    for p, b in zip(parts, before):
        np.testing.assert_array_equal(p, b)
    assert not any(np.shares_memory(out, p) for p in parts)


@pytest.mark.parametrize("op", [R.SUM, R.PRODUCT, R.MIN, R.MAX])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "int64"])
def test_int_reductions(dtype, op):
    parts = parts_of(dtype, world=4)
    got = reduce(parts, op, dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, reference(parts, op))


def test_int_sum_wraps_like_the_device():
    a = np.array([2**31 - 1, -(2**31)], np.int32)
    b = np.array([1, -1], np.int32)
    np.testing.assert_array_equal(reduce([a, b], R.SUM, "int32"), np.array([-(2**31), 2**31 - 1], np.int32))


@pytest.mark.parametrize("dtype", ["int32", "int64", "int8", "uint8"])
def test_avg_on_ints_divides_like_c(dtype):
    # NCCL's ncclAvg on integers is a sum followed by C division: it truncates toward zero
    rng = np.random.default_rng(5)
    lo = 0 if dtype == "uint8" else -30
    for world in (2, 3, 4):
        parts = [rng.integers(lo, 31, 500).astype(dtype) for _ in range(world)]
        total = np.sum(np.stack(parts).astype(np.int64), axis=0)
        want = (np.sign(total) * (np.abs(total) // world)).astype(dtype)
        got = reduce(parts, R.AVG, dtype)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, want)


def test_avg_on_ints_examples():
    a, b = np.array([-3, 3, -1, 7, -8], np.int32), np.array([0, 0, 0, 0, 0], np.int32)
    assert reduce([a, b], R.AVG, "int32").tolist() == [-1, 1, 0, 3, -4]
    three = [np.array([1, -1, 5], np.int64), np.array([1, -1, 5], np.int64), np.array([0, 0, 0], np.int64)]
    assert reduce(three, R.AVG, "int64").tolist() == [0, 0, 3]


@pytest.mark.parametrize(
    "op,fn", [(R.SUM, np.logical_or), (R.MAX, np.logical_or), (R.PRODUCT, np.logical_and), (R.MIN, np.logical_and)]
)
def test_bool_reductions(op, fn):
    rng = np.random.default_rng(1)
    parts = [rng.random(200) < 0.3 for _ in range(3)]
    got = reduce(parts, op, "bool")
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, fn.reduce(parts))


def test_bool_avg_is_refused():
    with pytest.raises(KernelError, match="avg is not defined for bool"):
        reduce([np.ones(3, bool)] * 2, R.AVG, "bool")
    with pytest.raises(KernelError):
        kernels.check_reduce(R.AVG, "bool")
    kernels.check_reduce(R.SUM, "bool")


# ---------------------------------------------------------------- bfloat16


def test_bf16_reference_rounding():
    # our test helper itself: truncation vs round-to-nearest-even on known bit patterns
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5, 0.0], np.float32)
    bits = bf16_bits(x)
    # 1+2^-8 is a tie between 1 (even) and 1+2^-7: goes to 1; 1+3*2^-8 ties to 1+2^-6 (even)
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F80, 0xC020, 0x0000]
    trunc = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert trunc.tolist()[2] == 0x3F81  # truncation differs from rounding here
    edge = np.array([3.3895e38, 3.4e38, -3.4e38, np.inf, np.nan], np.float32)
    bits = bf16_bits(edge)
    assert bits[0] == 0x7F7F and bits[1] == 0x7F80 and bits[2] == 0xFF80 and bits[3] == 0x7F80
    assert np.isnan(bf16_to_f32(bits[4:]))[0]


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("make_bits", ["round", "truncate"])
def test_bf16_reductions_match_float32_within_bf16_precision(op, world, make_bits):
    rng = np.random.default_rng(world)
    vals = [(rng.standard_normal(1000) * 3).astype(np.float32) for _ in range(world)]
    if make_bits == "round":
        bits = [bf16_bits(v) for v in vals]
    else:
        bits = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in vals]
    got = reduce(bits, op, "bfloat16")
    assert got.dtype == np.uint16 and got.shape == (1000,)
    # reference: the same bf16 inputs reduced in float32, rounded once at the end
    f32 = [bf16_to_f32(b) for b in bits]
    exact = reference(f32, op)
    np.testing.assert_array_equal(got, bf16_bits(exact))
    # and within bf16 precision of a float64 reduction
    wide = reference([x.astype(np.float64) for x in f32], op)
    np.testing.assert_allclose(bf16_to_f32(got), wide, rtol=2**-8, atol=1e-6)


def test_bf16_special_values():
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    a = bf16_bits(np.array([inf, -inf, 1.0, 3.0e38, 0.0], np.float32))
    b = bf16_bits(np.array([1.0, -1.0, nan, 3.0e38, -0.0], np.float32))
    with np.errstate(over="ignore", invalid="ignore"):
        got = bf16_to_f32(reduce([a, b], R.SUM, "bfloat16"))
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])
    assert got[3] == np.inf  # overflows past bf16's max, as on the device
    assert got[4] == 0.0


def test_typed_views_and_itemsize():
    raw = np.arange(16, dtype=np.uint8)
    assert typed(raw, "bfloat16").dtype == np.uint16 and typed(raw, "bfloat16").size == 8
    assert typed(raw, "float32").size == 4
    assert np.shares_memory(typed(raw, "int64"), raw)
    assert itemsize("bfloat16") == 2 and itemsize("bool") == 1 and itemsize("float64") == 8
    with pytest.raises(KernelError, match="unsupported dtype 'complex64'"):
        itemsize("complex64")
    with pytest.raises(KernelError):
        typed(raw, "float8_e4m3fn")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8", "bool", "bfloat16"])
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_into_matches_reduce_in_place_or_not(dtype, op, world):
    # the all-reduce kernel reduces straight into rank 0's buffer (its input, when in place)
    if dtype == "bool":
        parts = [np.random.default_rng(r).integers(0, 2, 257).astype(bool) for r in range(world)]
    elif dtype == "bfloat16":
        parts = [bf16_bits(np.random.default_rng(r).standard_normal(257).astype(np.float32)) for r in range(world)]
    else:
        parts = parts_of(dtype, world=world)
    if dtype == "bool" and op is R.AVG:
        with pytest.raises(KernelError):
            kernels.reduce_into(parts, op, dtype, np.empty_like(parts[0]))
        return
    want = reduce(parts, op, dtype)
    out = np.empty_like(parts[0])
    kernels.reduce_into(parts, op, dtype, out)
    np.testing.assert_array_equal(out, want)
    kernels.reduce_into(parts, op, dtype, parts[0])
    np.testing.assert_array_equal(parts[0], want)
