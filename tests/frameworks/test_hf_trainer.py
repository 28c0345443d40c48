"""Hugging Face transformers' `Trainer` on a tiny GPT-2 (from a config) under torchrun on emulated GPUs."""

from __future__ import annotations

import pytest

from tests.frameworks.fwrun import FW, assert_same_training, on_cpu, under_mirage

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

pytest.importorskip("transformers")


def test_trainer_gpt2_under_torchrun_matches_gloo(tmp_path):
    script = str(FW / "hf_trainer_gpt2.py")
    gpu = under_mirage(tmp_path, "torchrun", "--standalone", "--nproc_per_node=2", script, steps=8)
    cpu = on_cpu("torchrun", "--standalone", "--nproc_per_node=2", script, "--device", "cpu", steps=8)
    assert_same_training(gpu, cpu)
