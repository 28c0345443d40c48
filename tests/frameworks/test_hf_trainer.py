"""Hugging Face transformers' `Trainer` on a tiny GPT-2 (from a config) under torchrun on emulated GPUs."""

from __future__ import annotations

import pytest

from tests.frameworks.fwrun import FW, assert_same_training, mirage_in, on_cpu, result, under_mirage
from tests.test_run import REPO_ROOT

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

pytest.importorskip("transformers")


def test_trainer_gpt2_under_torchrun_matches_gloo(tmp_path):
    script = str(FW / "hf_trainer_gpt2.py")
    gpu = under_mirage(tmp_path, "torchrun", "--standalone", "--nproc_per_node=2", script, steps=8)
    cpu = on_cpu("torchrun", "--standalone", "--nproc_per_node=2", script, "--device", "cpu", steps=8)
    assert_same_training(gpu, cpu)


def test_trainer_with_torch_compile_matches_gloo_compiled(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model (inductor) under DDP; the same
    run on CPU + gloo compiles it too."""
    script = str(FW / "hf_trainer_gpt2.py")
    gpu = under_mirage(tmp_path, "env", "TORCH_COMPILE=1", "torchrun", "--standalone", "--nproc_per_node=2", script,
                       steps=6)
    assert gpu["graphs"] > 0, gpu
    cpu = on_cpu("torchrun", "--standalone", "--nproc_per_node=2", script, "--device", "cpu", steps=6,
                 extra_env={"TORCH_COMPILE": "1"})
    assert_same_training(gpu, cpu)


def test_trainer_under_plain_python_takes_data_parallel_over_both_gpus(tmp_path):
    """One process that sees two GPUs: the Trainer wraps the model in nn.DataParallel, as on a GPU machine."""
    script = str(FW / "hf_trainer_gpt2.py")
    r = mirage_in(REPO_ROOT, tmp_path, 2, "python", script, steps=8)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "parallel mode ParallelMode.NOT_DISTRIBUTED, n_gpu 2" in r.stdout, r.stdout[-3000:]
    assert "not compiled with NCCL support" not in r.stderr  # reduce_add takes NCCL's path, as with RCCL
    # nn.DataParallel splits the batch over the two GPUs and sums their gradients: one CPU process
    # with twice the per-GPU batch computes the same
    cpu = on_cpu("python", script, "--device", "cpu", steps=8, extra_env={"BATCH": "16"})
    assert_same_training(result(r.stdout), cpu)
