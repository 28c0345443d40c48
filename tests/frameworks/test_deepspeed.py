"""DeepSpeed ZeRO stages 1-3 with a torch AdamW on emulated GPUs, by torchrun and by DeepSpeed's launcher."""

from __future__ import annotations

import pytest

from tests.frameworks.fwrun import FW, assert_same_training, deepspeed_cpu_extensions, free_port, on_cpu, under_mirage

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

pytest.importorskip("deepspeed")
SCRIPT = str(FW / "deepspeed_zero.py")
STEPS = 12


@pytest.fixture(scope="module")
def cpu_result():
    # ZeRO's stages compute the same AdamW steps, so one CPU + gloo run (DeepSpeed's CPU
    # accelerator, stage 2) is the reference for all three.
    return on_cpu("torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, "--stage", "2", "--device", "cpu",
                  steps=STEPS, extra_env=deepspeed_cpu_extensions())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_under_torchrun_matches_gloo(tmp_path, cpu_result, stage):
    gpu = under_mirage(tmp_path, "torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, "--stage", str(stage),
                       steps=STEPS)
    assert gpu["tag"] == f"deepspeed_zero{stage}"
    assert_same_training(gpu, cpu_result)


def test_zero3_under_the_deepspeed_launcher_matches_gloo(tmp_path, cpu_result):
    """`deepspeed --num_gpus 2` counts the GPUs itself (torch.cuda.device_count()) and starts both ranks."""
    gpu = under_mirage(tmp_path, "deepspeed", "--num_gpus", "2", f"--master_port={free_port()}", SCRIPT,
                       "--stage", "3", steps=STEPS)
    assert_same_training(gpu, cpu_result)
