"""A transformers Llama under FSDP2 in ``--exec-mode estimate`` (issue 30, section 2): Llama-3-8B at its real
size on 8 emulated MI300X on this box, and, at a size clocked mode also runs, the same figures as clocked mode."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.frameworks.fwrun import FW, framework_env
from tests.test_run import REPO_ROOT

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

pytest.importorskip("transformers")

SCRIPT = str(FW / "llama_fsdp2.py")
#: a Llama small enough for clocked mode, with an embedding and a head past 1 MiB (no values in estimate mode)
SMALL = {"LAYERS": 2, "HIDDEN": 256, "INTERMEDIATE": 512, "HEADS": 4, "KV_HEADS": 2, "VOCAB": 32000, "SEQ": 256}


def _run(tmp_path, mode: str, gpus: int, sizes: dict, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    envs = [a for k, v in sizes.items() for a in ("--env", f"{k}={v}")]
    return subprocess.run(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--gpus-per-node", str(gpus),
         "--profile", "mi300x", "--exec-mode", mode, *envs, "--", "torchrun", "--nproc-per-node", str(gpus), SCRIPT],
        cwd=REPO_ROOT, env=framework_env(), capture_output=True, text=True, timeout=timeout)


def _figures(r: subprocess.CompletedProcess[str]) -> tuple[list[str], str]:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] llama_fsdp2_ok" in r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith(("[0] parameters", "[0] memory"))]
    (predicted,) = [line for line in r.stderr.splitlines() if "predicted step" in line]
    return lines, predicted.split("): ", 1)[1]  # without the mode it names


def test_estimate_gives_clocked_modes_figures_for_a_transformers_llama(tmp_path):
    clocked = _figures(_run(tmp_path / "clocked", "clocked", 2, SMALL))
    assert _figures(_run(tmp_path / "estimate", "estimate", 2, SMALL)) == clocked


def test_llama3_8b_trains_a_step_in_estimate_mode_on_eight_mi300x(tmp_path):
    """The real size: 8.03 B parameters, sequence 8192, FSDP2 over 8 GPUs, on a 24 GiB box with no GPU."""
    lines, predicted = _figures(_run(tmp_path, "estimate", 8, {}))
    assert lines[0] == "[0] parameters 8030261248", lines
    peak = int(re.search(r"peak allocated (\d+)", lines[1]).group(1))
    # sharded fp32 parameters, gradients and AdamW's moments: 4 x 4 bytes x 8.03e9 / 8 = 16 GB; the rest is
    # the activations of 32 layers at 8192 tokens without activation checkpointing; under the GPU's 192 GiB
    assert 40 << 30 < peak < 192 << 30, lines
    assert "predicted step" in predicted
