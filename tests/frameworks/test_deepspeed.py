"""DeepSpeed ZeRO stages 1-3 with a torch AdamW on emulated GPUs, by torchrun and by DeepSpeed's launcher, eager and
compiled (``engine.compile()``)."""

from __future__ import annotations

import pytest

from tests.frameworks.fwrun import (FW, assert_same_training, deepspeed_cpu_extensions, free_port, mirage_in, on_cpu,
                                   result, under_mirage)
from tests.test_run import REPO_ROOT

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


def test_zero3_compiled_by_engine_compile_matches_gloo_compiled(tmp_path):
    """``engine.compile()`` (DeepSpeed 0.19's compile: the accelerator's backend, inductor) around ZeRO-3, whose
    parameter hooks break the graph (torch.compiler.disable'd, 6 graphs): the same graphs, kernels and steps as
    on CPU + gloo compiled by the same inductor. Stages 1 and 2 compile one graph and match too (by hand)."""
    compiled = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a fresh cache: the kernels are generated
    r = mirage_in(REPO_ROOT, tmp_path, 2, "torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, "--stage", "3",
                  "--compile", steps=STEPS, extra_env=compiled)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    gpu = result(r.stdout)
    assert gpu["device"] == "cuda:0" and gpu["graphs"] > 0 and gpu["kernels"] > 0, gpu
    cpu = on_cpu("torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, "--stage", "3", "--compile", "--device",
                 "cpu", steps=STEPS, extra_env=deepspeed_cpu_extensions())
    assert gpu["graphs"] == cpu["graphs"], (gpu, cpu)
    assert_same_training(gpu, cpu)


def test_deepcompile_is_refused_in_one_line(tmp_path):
    """DeepCompile (``"compile": {"deepcompile": true}``) runs DeepSpeed's own C++/HIP op, which it would build
    with hipcc for the GPU's runtime: refused naming it, where DeepSpeed failed on ``CUDA_HOME`` being None."""
    r = mirage_in(REPO_ROOT, tmp_path, 2, "torchrun", "--standalone", "--nproc_per_node=2", SCRIPT, "--stage", "2",
                  "--deepcompile", steps=2)
    assert r.returncode != 0
    want = ("RuntimeError: mirage: DeepSpeed's 'dc' op (DeepCompileBuilder) is code DeepSpeed builds with nvcc or "
            "hipcc for a GPU's own runtime, which emulated GPUs do not have: it cannot run under mirage (DeepCompile")
    assert want in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert "not NoneType" not in r.stdout + r.stderr
