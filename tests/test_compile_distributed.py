"""Distributed programs under ``torch.compile`` (inductor) on emulated GPUs, compared with CPU + gloo (issue 28).

``tests/fixtures/ml/compiled_train.py --case all`` runs, in one torchrun job of
two ranks: functional collectives traced into a compiled graph (all_reduce,
all_gather_tensor, reduce_scatter_tensor, which the compiled code runs through
mirage's process group and daemon), a tensor-parallel MLP compiled (DTensor),
FSDP2 with every block compiled (torchtitan's pattern), and ``torch.compile(DDP(model))``
with dynamo's DDPOptimizer (the graph split at 1 MB buckets) and with compiled
autograd tracing the reducer (``optimize_ddp="python_reducer"``). The same
program runs plainly on CPU tensors with gloo, compiled by the same inductor;
every loss and checksum must agree.
"""

from __future__ import annotations

import json
import re

import pytest

from test_run import FIXTURES, mirage_run, run_dir
from test_training import run_on_cpu

# a set of its own (bash tests/run_suite.sh -m compile), which .ci/run runs after the default suite
pytestmark = [pytest.mark.usefixtures("no_orphans"), pytest.mark.slow, pytest.mark.e2e, pytest.mark.compile]

#: "[rank 1] ddp-python_reducer step 3 loss 0.829074", "[rank 0] tp checksum 314.489422"
_FIGURE = re.compile(r"\[rank (\d+)\] ([\w-]+ (?:step \d+ loss|checksum)) (-?\d+\.\d+)")


def figures(text: str) -> dict[tuple[str, str], float]:
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in _FIGURE.finditer(text)}


def test_compiled_ddp_fsdp2_tp_and_functional_collectives_match_gloo(tmp_path):
    steps = 3
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "compiled_train.py"), "--case", "all", steps=steps, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "[0] compiled_train_ok" in r.stdout
    cpu = run_on_cpu(str(FIXTURES / "compiled_train.py"), "--case", "all", nprocs=2, steps=steps)
    got, want = figures(r.stdout), figures(cpu)
    cases = {what.split()[0] for _, what in want}
    assert cases == {"funcol", "tp", "fsdp2", "ddp-ddp_optimizer", "ddp-python_reducer"}, cases
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (key, got[key], value)


def test_a_hang_inside_a_compiled_graph_is_reported_as_any_other(tmp_path):
    """A collective the compiled code runs is in the daemon's ledger: a rank that never joins it (injected at
    rank 1's fifth collective, step 2's all_gather of the compiled function) is reported by the hang detector."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", "20", "--inject", "rank=1,seq=5,action=hang",
                   "--", "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "compiled_train.py"),
                   "--case", "funcol", steps=4, timeout=300)
    assert r.returncode == 124, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[1] mirage: injecting hang at collective #5 of rank 1" in r.stderr
    assert "HANG: collective #5 (ALLGATHER" in r.stderr and "missing ranks: {1}" in r.stderr, r.stderr[-3000:]


SLOW_COMPILE = r'''
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)


def slow_on_rank_1(gm, example_inputs):
    if rank == 1:
        time.sleep(6)  # rank 1 compiles three times the hang timeout while rank 0 waits in the all_reduce
    return gm


@torch.compile(backend=slow_on_rank_1)
def step(t):
    return (t * 2).sin()


x = step(torch.ones(4, device="cuda"))
dist.all_reduce(x)
print(f"[rank {rank}] slow_compile_ok {x.sum().item():.4f}", flush=True)
dist.destroy_process_group()
'''


def test_a_rank_still_compiling_is_not_a_hang(tmp_path):
    """Rank 1 compiles for 6 s while rank 0 waits in the next all_reduce, with a 2 s hang timeout: a rank
    compiling is paused, not missing (its wait counts from when it finished), so the run completes."""
    prog = tmp_path / "slow_compile.py"
    prog.write_text(SLOW_COMPILE)
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", "2", "--", "torchrun", "--standalone",
                   "--nproc_per_node=2", str(prog), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "HANG" not in r.stderr
    assert "[1] [rank 1] slow_compile_ok" in r.stdout
    # the console is told: each rank's compilations begin and end, so its state reads "compiling" meanwhile
    with open(run_dir(tmp_path) / "events.jsonl") as f:
        events = [json.loads(line) for line in f]
    for rank in (0, 1):
        marks = [e["compiling"] for e in events if e["type"] == "rank_compiling" and e["rank"] == rank]
        assert marks and marks[0] is True and marks[-1] is False, (rank, marks)
        assert all(a != b for a, b in zip(marks, marks[1:])), (rank, marks)
