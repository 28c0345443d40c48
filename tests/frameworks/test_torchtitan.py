"""torchtitan 0.2.2's Llama 3 debug model under ``--compile.enable`` on emulated GPUs (issue 28).

``torchrun -m torchtitan.train`` with the llama3 ``debugmodel`` flavour, FSDP2 over 2 GPUs,
selective activation checkpointing, and torchtitan's compile: every TransformerBlock
``torch.compile``d with ``fullgraph=True`` under FSDP2, and the cross-entropy loss compiled.
No CPU + gloo reference: torchtitan takes the ``cuda`` device whenever none is available,
so it cannot run on the CPU; the reference is the same run eager (the same seed: the same
initial weights and batches), whose losses inductor's must follow within its tolerance.
That it compiled is counted in the run's inductor cache (the C++ kernels it wrote).

torchtitan and its extra packages are installed on first use (tests/frameworks/torchtitan_env.py);
without a package index the test skips saying why. The assets are made by
tests/fixtures/frameworks/torchtitan/make_assets.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.frameworks import torchtitan_env
from tests.frameworks.fwrun import FW, framework_env
from tests.test_run import REPO_ROOT

# with the compiled programs (bash tests/run_suite.sh -m compile), which .ci/run runs after the default suite
pytestmark = [pytest.mark.compile, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

STEPS = 5
#: "[0] [titan] 2026-12-07 06:12:31,275 - root - INFO - step:  1  loss:  8.01949  grad_norm:  1.7566 ..."
_STEP = re.compile(r"^\[(\d+)\] .*step:\s+(\d+)\s+loss:\s+([-\d.]+)\s+grad_norm:\s+([-\d.]+)", re.M)


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> tuple[Path, Path]:
    """(the folder torchtitan is imported from, the folder of the run's assets)."""
    overlay, why = torchtitan_env.overlay()
    if overlay is None:
        pytest.skip(why)
    assets = tmp_path_factory.mktemp("titan")
    subprocess.run([sys.executable, str(FW / "torchtitan" / "make_assets.py"), str(assets)], check=True)
    return overlay, assets


def train(tmp_path: Path, titan: tuple[Path, Path], *flags: str, mode: str = "functional") -> dict:
    """Train STEPS steps on 2 emulated GPUs; each rank's (step, loss, grad_norm) and the kernels inductor wrote."""
    overlay, assets = titan
    env = framework_env() | {
        "PYTHONPATH": os.pathsep.join([str(overlay), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    r = subprocess.run(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--gpus-per-node", "2",
         "--exec-mode", mode, "--", "torchrun", "--standalone", "--nproc_per_node=2", "-m", "torchtitan.train",
         "--job.config_file", str(assets / "debug_model.toml"), "--job.dump_folder", str(tmp_path / "out"),
         "--training.steps", str(STEPS), *flags],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    ranks: dict[int, list[tuple[int, float, float]]] = {}
    for m in _STEP.finditer(r.stdout):
        ranks.setdefault(int(m.group(1)), []).append((int(m.group(2)), float(m.group(3)), float(m.group(4))))
    assert sorted(ranks) == [0, 1] and all(len(s) == STEPS for s in ranks.values()), r.stdout[-4000:]
    assert ranks[0] == ranks[1], ranks  # FSDP: every rank logs the global loss
    kernels = sum(f.read_text().count("cpp_fused_") > 0 for f in (tmp_path / "inductor").rglob("*.py"))
    return {"steps": ranks[0], "kernel_modules": kernels, "out": r.stdout}


def test_llama3_debug_model_compiled_follows_eager(tmp_path, titan):
    # short folders: the daemon's socket paths live under the log folder (at most 70 bytes)
    compiled = train(tmp_path / "c", titan, "--compile.enable")
    assert compiled["kernel_modules"] > 0, compiled["out"][-3000:]
    eager = train(tmp_path / "e", titan)
    assert eager["kernel_modules"] == 0
    losses = [loss for _, loss, _ in compiled["steps"]]
    assert losses[-1] < losses[0], compiled["steps"]
    for (step, loss, norm), (_, want, want_norm) in zip(compiled["steps"], eager["steps"]):
        assert loss == pytest.approx(want, rel=1e-3), (step, compiled["steps"], eager["steps"])
        assert norm == pytest.approx(want_norm, rel=5e-3), (step, compiled["steps"], eager["steps"])
