"""Megatron Core's quickstart, unmodified (tests/fixtures/frameworks/megatron/), as its README runs it.

``torchrun --nproc_per_node=2 examples/run_simple_mcore_train_loop.py`` from the repository root: a
GPT split over 2 GPUs by tensor parallelism (nccl, ``torch.cuda.set_device``, ``device("cuda")``),
Megatron's DDP and pipeline schedule, its MockGPTDataset (C++ helpers built by ``make`` with
pybind11), 5 Adam steps, a distributed checkpoint saved and loaded. ``import megatron.training``
imports Triton (Megatron's batch-invariant kernels are ``@triton.jit`` at import time).

No CPU + gloo reference: the program hard-codes nccl and cuda, and Megatron Core itself needs CUDA
(``model_parallel_cuda_manual_seed``'s CUDA RNG tracker, buffers on ``torch.cuda.current_device()``),
its dropout drawing from the CUDA generator. The checks are the losses both TP ranks print: the
same on both (the vocabulary-parallel cross-entropy all-reduces across them), on ``cuda:<rank>``,
and those of an untrained 100-token vocabulary (ln 100).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.frameworks.fwrun import FW, mirage_in

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

pytest.importorskip("pybind11")
_CORE = importlib.util.find_spec("megatron.core")
if _CORE is None:
    pytest.skip("megatron-core is not installed (the frameworks extra)", allow_module_level=True)

_LOSS = re.compile(r"^\[(\d)\] Iteration (\d): Losses reduced: \[\{'lm loss': tensor\(([-\d.naif]+), "
                   r"device='(cuda:\d)', grad_fn=<DivBackward0>\)\}\]$", re.M)


def _checkout(tmp_path: Path) -> Path:
    """A Megatron-LM checkout at core_v0.16.1 as far as the example reads it.

    The vendored files, with the installed megatron-core laid in as ``megatron/core`` (the tag's
    Python files; the wheel adds the dataset helpers built for this interpreter, touched so that
    ``make`` finds them up to date rather than compiling them again for 15 s).
    """
    work = tmp_path / "Megatron-LM"
    shutil.copytree(FW / "megatron", work)
    shutil.copytree(Path(_CORE.submodule_search_locations[0]), work / "megatron" / "core", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for built in (work / "megatron" / "core" / "datasets").glob("helpers_cpp*"):
        built.touch()
    return work


def _python3_config(tmp_path: Path) -> Path:
    """A ``python3-config`` answering for this interpreter, on PATH for the run.

    The Makefile names the helpers ``helpers_cpp$(python3-config --extension-suffix)``; a venv has
    no python3-config, and the one PATH finds may be another Python's (pyenv's 3.12 here: the
    helpers are then built as ``...cpython-312...so`` and ``import helpers_cpp`` fails on 3.11).
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3_config.py").write_text(
        "import sys, sysconfig\n"
        "if sys.argv[1:] != ['--extension-suffix']:\n"
        "    sys.exit('python3-config (test_megatron.py): only --extension-suffix')\n"
        "print(sysconfig.get_config_var('EXT_SUFFIX'))\n")
    tool = bin_dir / "python3-config"
    tool.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{bin_dir / "python3_config.py"}" "$@"\n')
    tool.chmod(0o755)
    return bin_dir


def test_run_simple_mcore_train_loop_tp2(tmp_path):
    work = _checkout(tmp_path)
    env = {"PYTHONPATH": str(work),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), str(_python3_config(tmp_path)),
                                    os.environ.get("PATH", "")])}
    r = mirage_in(work, tmp_path / "r", 2, "torchrun", "--nproc-per-node", "2",
                  "examples/run_simple_mcore_train_loop.py", extra_env=env, timeout=240)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "mirage: ok" in r.stderr, r.stderr[-2000:]

    losses: dict[int, list[float]] = {0: [], 1: []}
    for rank, step, value, device in _LOSS.findall(r.stdout):
        assert device == f"cuda:{rank}", (rank, device)
        assert int(step) == len(losses[int(rank)])
        losses[int(rank)].append(float(value))
    assert len(losses[0]) == 5, r.stdout[-5000:]
    assert losses[0] == losses[1], losses
    assert all(math.isfinite(x) and abs(x - math.log(100)) < 0.05 for x in losses[0]), losses
    for rank in (0, 1):
        assert f"[{rank}] Successfully loaded the model" in r.stdout.splitlines(), r.stdout[-3000:]
    assert (work / "ckpt" / ".metadata").is_file(), sorted(p.name for p in (work / "ckpt").iterdir())
