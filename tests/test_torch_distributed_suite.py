"""A representative handful of PyTorch's own ``DistributedTest`` (the installed wheel's
``torch/testing/_internal/distributed/distributed_test.py``, ``BACKEND=nccl``, 2 GPUs) under mirage.

The whole selection (every ``*_cuda`` and DDP test) is ``python bench/distributed_suite.py``;
its table is in docs/compatibility.md. These few cover what this project fixed for it: the
profiler's collective events (``call_dist_op`` counts them, checks they are async and their
input shapes), DDP's runtime logging data, plain DDP training compared on every rank, and DDP's
``Join`` over uneven inputs.
"""

from __future__ import annotations

import sys

import pytest

from test_run import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import distributed_suite  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

#: each spawns its 2 ranks afresh (~20 s apiece on two busy cores)
SUBSET = [
    "test_all_reduce_sum_cuda_async",  # profiler: one async "nccl:all_reduce" event with its input shape
    "test_all_gather_cuda",  # profiler: "nccl:all_gather", shapes
    "test_ddp_logging_data_gpu",  # DDP's forward / backward / communication times
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_grad_div_uneven_inputs",  # Join: the reducer waits on Join's all-reduce Work in backward
]


def test_distributed_test_subset_passes():
    rows, _, rc = distributed_suite.run(2, None, timeout_s=600, extra=[], names=SUBSET)
    outcomes = {name: (outcome, reason) for name, outcome, reason, _ in rows}
    assert set(outcomes) == set(SUBSET), outcomes
    failed = {name: why for name, (outcome, why) in outcomes.items() if outcome != "passed"}
    assert not failed, failed
    assert rc == 0
