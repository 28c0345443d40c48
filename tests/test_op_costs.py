"""Clocked mode's costs found again by signature (shim/clock/op_costs.py): on the tensors' metadata, then a real run."""

from __future__ import annotations

import ctypes
import json
from fractions import Fraction

import pytest
import torch

from shim.clock import op_costs
from shim.clock.op_costs import OpCosts, signature
from shim.native import build as native_build
from shim.clock.roofline import op_cost
from test_run import FIXTURES, events, mirage_run, run_dir
from wire.profiles import load_profile

aten = torch.ops.aten
MI300X = load_profile("mi300x")


def _native_signature():
    """The C++ signature (shim/native/fast_dispatch.cpp), loaded as shim/tensor/fast_dispatch.py loads it."""
    lib = native_build.load(native_build.FAST_DISPATCH_SOURCE, "the fast dispatch kernels", ctypes.PyDLL)
    lib.mirage_op_signature.restype = ctypes.py_object
    return lib.mirage_op_signature()


@pytest.fixture(params=["python", "c++"])
def keyed(request, monkeypatch):
    """Signatures (and OpCosts' table) built in Python, then in C++, as a rank without and with the fast
    dispatch builds them."""
    monkeypatch.setattr(op_costs, "_native_signature", None if request.param == "python" else _native_signature())
    return request.param


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_a_repeated_call_is_priced_once_as_op_cost_prices_it(keyed):
    costs = OpCosts(MI300X)
    a, b = meta(64, 128), meta(128, 32)
    out = torch.mm(a, b)
    first = costs.cost(aten.mm.default, (a, b), {}, out)
    assert first == op_cost(aten.mm.default, (a, b), {}, out, MI300X)
    # other tensors of the same signature: the same cost, not worked out again
    a2, b2 = meta(64, 128), meta(128, 32)
    assert costs.cost(aten.mm.default, (a2, b2), {}, torch.mm(a2, b2)) is first
    assert (costs.hits, costs.misses) == (1, 1)


def test_a_changed_signature_gets_a_new_cost(keyed):
    """Each call that differs from the first in one thing op_cost may read gets its own entry, priced afresh
    (and where the difference changes the price, a different one)."""
    costs = OpCosts(MI300X)
    x, y = meta(256, 256), meta(256, 256)
    row = meta(256)
    calls = {
        "x + y": (aten.add.Tensor, (x, y), {}, x + y),
        "x + x (read once)": (aten.add.Tensor, (x, x), {}, x + x),
        "a broadcast row (stride 0)": (aten.add.Tensor, (row.expand(256, 256), y), {}, x + y),
        "x.t() + y (other strides)": (aten.add.Tensor, (x.t(), y), {}, x + y),
        "another shape": (aten.add.Tensor, (meta(256, 128), meta(256, 128)), {}, meta(256, 128)),
        "another dtype": (aten.add.Tensor, (meta(256, 256, dtype=torch.bfloat16), meta(256, 256, dtype=torch.bfloat16)),
                          {}, meta(256, 256, dtype=torch.bfloat16)),
        "alpha=2": (aten.add.Tensor, (x, y), {"alpha": 2}, x + y),
        "alpha=2.0": (aten.add.Tensor, (x, y), {"alpha": 2.0}, x + y),
        "alpha=True": (aten.add.Tensor, (x, y), {"alpha": True}, x + y),
        "x - y": (aten.sub.Tensor, (x, y), {}, x - y),
        "x.add_(y) (writes x)": (aten.add_.Tensor, (x, y), {}, x),
        "x.copy_(y) (writes x only)": (aten.copy_.default, (x, y), {}, x),
    }
    priced = {}
    for name, (func, args, kwargs, out) in calls.items():
        priced[name] = costs.cost(func, args, kwargs, out)
        assert priced[name] == op_cost(func, args, kwargs, out, MI300X), name
    assert (costs.hits, costs.misses) == (0, len(calls))
    assert len({signature(*call) for call in calls.values()}) == len(calls)
    # the differences that move bytes change the price
    assert priced["x + x (read once)"].bytes == priced["x + y"].bytes - 256 * 256 * 4
    assert priced["a broadcast row (stride 0)"].bytes == priced["x + y"].bytes - 255 * 256 * 4
    assert priced["x.copy_(y) (writes x only)"].bytes == priced["x.add_(y) (writes x)"].bytes - 256 * 256 * 4
    for name, (func, args, kwargs, out) in calls.items():  # and each is found again
        assert costs.cost(func, args, kwargs, out) is priced[name], name
    assert costs.hits == len(calls)


def test_an_op_priced_by_its_bytes_is_found_again_whatever_its_numbers(keyed):
    """Adam's bias corrections change every step; the kernel's bytes do not: one entry. An op whose FLOP
    formula may read its numbers keeps them apart."""
    costs = OpCosts(MI300X)
    xs = [meta(64), meta(8, 8)]
    first = costs.cost(aten._foreach_div_.ScalarList, (xs, [0.9, 0.99]), {}, None)
    again = costs.cost(aten._foreach_div_.ScalarList, (xs, [0.81, 0.9801]), {}, None)
    assert again is first and first == op_cost(aten._foreach_div_.ScalarList, (xs, [0.5, 0.25]), {}, None, MI300X)
    assert costs.cost(aten._foreach_div_.ScalarList, ([meta(65), meta(8, 8)], [0.9, 0.99]), {}, None) != first
    # an int where a float stood is still another signature
    assert signature(aten.mul.Scalar, (xs[0], 2), {}, xs[0]) != signature(aten.mul.Scalar, (xs[0], 2.0), {}, xs[0])
    a, b, c = meta(64, 64), meta(64, 32), meta(32, 64)
    assert (signature(aten.addmm.default, (a, b, c), {"alpha": 2.0}, a)
            != signature(aten.addmm.default, (a, b, c), {"alpha": 3.0}, a))
    assert (costs.hits, costs.misses) == (1, 2)


def test_an_argument_a_signature_cannot_hold_is_priced_afresh_each_time(keyed):
    """An object of the program's among the numbers of an op with a FLOP formula; an op priced by its bytes
    holds any argument by its type (a generator: bernoulli's bytes do not depend on it)."""
    costs = OpCosts(MI300X)
    a, b, c = meta(64, 64), meta(64, 32), meta(32, 64)
    call = (aten.addmm.default, (a, b, c), {"alpha": Fraction(1, 2)}, a)
    assert signature(*call) is None
    assert costs.cost(*call) == op_cost(*call, MI300X)
    costs.cost(*call)
    assert (costs.hits, costs.misses) == (0, 2)
    x = meta(16)
    bernoulli = (aten.bernoulli.p, (x, 0.5), {"generator": torch.Generator()}, x)
    assert costs.cost(*bernoulli) is costs.cost(*bernoulli[:2], {"generator": torch.Generator()}, x)


# The DDP demo with clocked mode's Python table of costs replaced by op_cost itself (UNCACHED=1).
_DDP = """
import os, runpy
import torch  # first: importing torch activates the shim
from shim.clock.roofline import op_cost
from shim.rank.runtime import RUNTIME

clock = RUNTIME.clock
if os.environ.get("UNCACHED") == "1":
    clock.costs.cost = lambda func, args, kwargs, out: op_cost(func, args, kwargs, out, clock.profile)
runpy.run_path({fixture!r}, run_name="__main__")
print("costs found again", clock.costs.hits, "priced", clock.costs.misses)
from shim.clock import op_costs
print("signatures in C++:", op_costs._native_signature is not None)
"""


def _same_host_pid(trace: list[dict]) -> list[dict]:
    """A rank's trace events, its host track's process and thread ids (the rank's own) replaced by "host"."""
    (pid,) = {e["pid"] for e in trace if e["name"] == "process_name" and e["args"]["name"] == "host"}
    return [dict(e, pid="host", tid="host") if e["pid"] == pid else e for e in trace]


def _clocked_ddp(tmp_path, uncached: bool) -> tuple[list, list, dict, str]:
    """The DDP demo, clocked, on 2 GPUs: each rank's trace events, the clocked steps, the report's clocked
    section, and rank 0's count of costs found again and priced."""
    tmp_path.mkdir()
    program = tmp_path / "ddp.py"
    program.write_text(_DDP.format(fixture=str(FIXTURES / "ddp_mlp.py")))
    r = mirage_run(tmp_path / "r", "--exec-mode", "clocked", "--gpus-per-node", "2", "--env",
                   f"UNCACHED={int(uncached)}", "--nproc-per-node", "2", "--", "python", str(program),
                   steps=6)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] signatures in C++: True" in r.stdout.splitlines()  # (built by tests/setup_venv.sh)
    out = run_dir(tmp_path / "r")
    traces = [_same_host_pid(json.loads((out / "traces" / f"rank-{rank}.json").read_text())["traceEvents"])
              for rank in (0, 1)]
    steps = sorted(((e["rank"], e["step"]), {k: v for k, v in e.items() if k != "t"})
                   for e in events(tmp_path / "r") if e["type"] == "clocked_step")
    (counts,) = [line for line in r.stdout.splitlines() if line.startswith("[0] costs found again")]
    return traces, steps, json.loads((out / "report.json").read_text())["clocked"], counts


@pytest.mark.usefixtures("no_orphans")
def test_the_table_of_costs_leaves_a_clocked_ddp_run_exactly_as_it_was(tmp_path):
    """Kernel for kernel, step for step, the same emulated times with the costs found again by signature as
    with every op priced afresh (the reference)."""
    traces, steps, report, counts = _clocked_ddp(tmp_path / "c", uncached=False)
    ref_traces, ref_steps, ref_report, ref_counts = _clocked_ddp(tmp_path / "u", uncached=True)
    assert len(steps) == 2 * 6 and steps == ref_steps
    assert report == ref_report
    for rank in (0, 1):
        kernels = [e for e in traces[rank] if e.get("cat") == "kernel"]
        assert len(kernels) > 200
        assert traces[rank] == ref_traces[rank], rank
    found, priced = map(int, counts.split()[-3::2])
    assert found > 2 * priced, counts  # the steps repeat their ops: most costs are found again
    assert ref_counts == "[0] costs found again 0 priced 0"
