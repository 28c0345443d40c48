"""Tensor and sequence parallel with DTensor (issue 7), on emulated GPUs, no mocks.

Each fixture (1-D TP + SP on 2 GPUs; FSDP2 x TP on a 2 x 2 mesh) trains the
parallel model and an unsharded CPU copy side by side and fails unless losses
and weights match.
"""

from __future__ import annotations

import re

import pytest

from tests.test_run import FIXTURES, mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")


def test_tensor_and_sequence_parallel_match_a_single_device(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "tp_sp.py"), steps=3)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] tp_sp_ok" in r.stdout.splitlines()
    assert "[0] step 2: loss" in r.stdout


@pytest.mark.parametrize("mode", ["functional", "clocked"])
def test_fsdp2_over_dp_with_tensor_parallel_over_tp_on_four_gpus(tmp_path, mode):
    # clocked: DTensor's all-gather chunks views of storages torch has invalidated; the clock must not trip on them
    r = mirage_run(tmp_path, "--gpus-per-node", "4", "--exec-mode", mode, "--nproc-per-node", "4", "--", "python",
                   str(FIXTURES / "fsdp_tp_2d.py"), steps=3)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] fsdp_tp_2d_ok" in r.stdout.splitlines()
    if mode == "clocked":  # 3 steps of the sharded model's optimizer; the CPU reference's steps end none
        assert re.search(r"predicted step .* over steps 2-3, slowest rank", r.stderr), r.stderr[-3000:]


def test_context_parallel_ring_attention_matches_the_unsharded_block(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "context_parallel.py"), steps=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] context_parallel_ok" in r.stdout.splitlines()
    assert "[0] step 1: loss" in r.stdout
