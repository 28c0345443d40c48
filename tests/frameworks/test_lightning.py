"""PyTorch Lightning under mirage: ``Trainer(accelerator="gpu", devices=2)`` run as plain ``python train.py``
(Lightning starts the second rank itself), compared with the same workload on CPU + gloo."""

from __future__ import annotations

import sys

import pytest

from test_run import REPO_ROOT, mirage_run
from tests.frameworks.fwrun import on_cpu, result

pytest.importorskip("lightning")
pytestmark = [pytest.mark.frameworks, pytest.mark.usefixtures("no_orphans")]
SCRIPT = REPO_ROOT / "tests" / "fixtures" / "frameworks" / "lightning_train.py"


def _on_cpu(strategy: str, *more: str) -> dict:
    """The workload on CPU + gloo, without mirage (Lightning starts its own second process there too)."""
    return on_cpu(sys.executable, str(SCRIPT), "cpu", strategy, *more, timeout=300)


def test_lightning_ddp_on_two_gpus_matches_cpu_gloo(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "python", str(SCRIPT), "gpu", "ddp", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] [rank 0] trained on cuda:0 with nccl" in r.stdout
    assert "[1] [rank 1] trained on cuda:1 with nccl" in r.stdout  # the rank Lightning started, named as itself
    # ... from its first line, before its init_process_group (Lightning logs to stderr)
    assert "[1] Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in r.stderr.splitlines(), r.stderr[-3000:]
    gpu = result(r.stdout)
    assert gpu["device"] == "cuda:0" and gpu["world"] == 2 and gpu["final"] < gpu["first"]
    cpu = _on_cpu("ddp")
    assert gpu["first"] == cpu["first"]
    assert gpu["final"] == pytest.approx(cpu["final"], rel=1e-4)
    assert gpu["checksum"] == pytest.approx(cpu["checksum"], rel=1e-4)


def test_lightning_fsdp_on_two_gpus_matches_cpu_gloo(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "python", str(SCRIPT), "gpu", "fsdp", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[1] [rank 1] trained on cuda:1 with nccl" in r.stdout
    gpu = result(r.stdout)
    cpu = _on_cpu("ddp")  # Lightning's FSDP refuses the CPU; full sharding with SGD computes what DDP does
    assert gpu["final"] == pytest.approx(cpu["final"], rel=1e-4)


def test_lightning_fits_a_compiled_module_as_on_cpu_gloo(tmp_path):
    """``trainer.fit(torch.compile(module))`` under DDP: inductor compiles the forward on the emulated GPUs."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "python", str(SCRIPT), "gpu", "ddp", "compile",
                   timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    gpu = result(r.stdout)
    assert gpu["device"] == "cuda:0" and gpu["graphs"] > 0, gpu
    cpu = _on_cpu("ddp", "compile")
    assert gpu["final"] == pytest.approx(cpu["final"], rel=1e-4)
    assert gpu["checksum"] == pytest.approx(cpu["checksum"], rel=1e-4)
