"""FSDP1 (`FullyShardedDataParallel`) on a CPU-built model moved by `device_id`, on emulated GPUs."""

from __future__ import annotations

import pytest

from tests.frameworks.fwrun import FW, assert_same_training, on_cpu, under_mirage

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

SCRIPT = str(FW / "fsdp1_train.py")


@pytest.fixture(scope="module")
def cpu_result():
    return on_cpu("torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, "--device", "cpu", steps=12)


@pytest.mark.parametrize("device_id", [
    "int",
    "device",
])
def test_fsdp1_device_id_matches_gloo(tmp_path, cpu_result, device_id):
    """`device_id=torch.cuda.current_device()` (an int) and `torch.device("cuda", i)`."""
    extra = ["--device-id-as-device"] if device_id == "device" else []
    gpu = under_mirage(tmp_path, "torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, *extra, steps=12)
    assert_same_training(gpu, cpu_result)
