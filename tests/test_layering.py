"""The layering rules of docs/architecture.md and the lint rule set, checked by the tools that state them.

The contracts are in ``pyproject.toml`` (``[tool.importlinter]``): the emulator
imports neither torch, Textual nor the other components; the shim neither
Textual nor the console; batch mode and the console outside ``mirage_tui/app``
never Textual; no import cycle among the modules of a package. ``ruff check``
runs the small rule set of ``[tool.ruff]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    # no cache: a stale one must not hide a new import
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(BIN / tool), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_import_contracts_are_kept():
    done = _run("lint-imports", "--no-cache")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
