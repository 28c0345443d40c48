"""Hugging Face Accelerate under mirage: `accelerate launch --multi_gpu`, and Accelerate's own test script."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from mirage_tui.hosts.processes import free_port
from tests.frameworks.fwrun import FW, assert_same_training, framework_env, mirage_in, on_cpu, under_mirage
from tests.test_run import REPO_ROOT

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

accelerate = pytest.importorskip("accelerate")
LAUNCH = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]


def launch(*options: str) -> list[str]:
    """``accelerate launch`` with LAUNCH's options (then ``options``) on a free port: its default, 29500, is
    taken when two of these tests run at once (pytest-xdist's two workers)."""
    return [*LAUNCH, *options, "--main_process_port", str(free_port())]


def test_accelerate_launch_with_dynamo_backend_inductor_matches_gloo_compiled(tmp_path):
    """``accelerate launch --dynamo_backend inductor``: Accelerate compiles the prepared model; on CPU + gloo
    the same environment variable it sets (ACCELERATE_DYNAMO_BACKEND) compiles it there."""
    gpu = under_mirage(tmp_path, *launch("--dynamo_backend", "inductor"), str(FW / "accelerate_train.py"), steps=4)
    cpu = on_cpu("torchrun", "--standalone", "--nproc_per_node=2", str(FW / "accelerate_train.py"),
                 steps=4, extra_env={"ACCELERATE_USE_CPU": "1", "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})
    assert_same_training(gpu, cpu)
    assert gpu["graphs"] > 0, gpu
    assert gpu["graphs"] == cpu["graphs"], (gpu, cpu)  # what torch compiles of DDP(model) there, and no more


def test_accelerate_launch_multi_gpu_matches_gloo(tmp_path):
    gpu = under_mirage(tmp_path, *launch(), str(FW / "accelerate_train.py"), steps=4)
    # Accelerate's launcher has no multi-process CPU mode without MPI; torchrun with
    # ACCELERATE_USE_CPU=1 gives its MULTI_CPU (gloo) path.
    cpu = on_cpu("torchrun", "--standalone", "--nproc_per_node=2", str(FW / "accelerate_train.py"),
                 steps=4, extra_env={"ACCELERATE_USE_CPU": "1"})
    assert_same_training(gpu, cpu)


_SECTION = re.compile(r"^(?:\[\d+\] )?(\*\*[^*]+\*\*)$", re.M)


def test_accelerates_own_test_script_passes_every_section(tmp_path):
    """accelerate/test_utils/scripts/test_script.py: every section it runs on CPU + gloo, then exit 0."""
    script = str(Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_script.py")
    r = mirage_in(REPO_ROOT, tmp_path, 2, *launch(), script)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    env = framework_env()
    env["ACCELERATE_USE_CPU"] = "1"
    c = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", script], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=280)
    assert c.returncode == 0, c.stdout[-5000:] + c.stderr[-5000:]
    cpu_sections = set(_SECTION.findall(c.stdout))
    assert "**Training integration test**" in cpu_sections, c.stdout[-3000:]
    # on GPUs the script runs more sections (e.g. the CUDA-only ones); none of the CPU's may be missing
    assert cpu_sections <= set(_SECTION.findall(r.stdout)), r.stdout[-5000:]


def test_accelerate_config_default_then_accelerate_test(tmp_path):
    """A new user's first two commands: Accelerate writes a multi-GPU config for the 2 GPUs it sees, and its
    ``accelerate test`` launches its test script with it and reports success."""
    hf_home = tmp_path / "hf"
    config = mirage_in(REPO_ROOT, tmp_path / "config", 2, "env", f"HF_HOME={hf_home}", "accelerate", "config",
                       "default")
    assert config.returncode == 0, config.stdout[-3000:] + config.stderr[-3000:]
    written = json.loads((hf_home / "accelerate" / "default_config.yaml").read_text())
    assert (written["distributed_type"], written["num_processes"]) == ("MULTI_GPU", 2), written
    r = mirage_in(REPO_ROOT, tmp_path / "test", 2, "env", f"HF_HOME={hf_home}", "accelerate", "test")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "[0] Device: cuda:0" in r.stdout and "[1] Device: cuda:1" in r.stdout, r.stdout[-5000:]
    assert "Test is a success! You are ready for your distributed training!" in r.stdout, r.stdout[-5000:]
