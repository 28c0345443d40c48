"""The layering rules of docs/architecture.md and the lint rule set, checked by the tools that state them.

The contracts are in ``pyproject.toml`` (``[tool.importlinter]``): the emulator
imports neither torch, Textual nor the other components; the shim neither
Textual nor the console; batch mode and the console outside ``mirage_tui/app``
never Textual; no import cycle among the modules of a package. ``ruff check``
runs the small rule set of ``[tool.ruff]``.

A new module of ``mirage_tui`` is covered or the check fails: the layers
contract is exhaustive (import-linter names a module no layer holds), and the
"never Textual" contract lists its modules by name, so a test here compares that
list with the package's files.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
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


#: The modules of mirage_tui that may import Textual: the app's package, and cli, which builds the app
#: (lazily: its own import stays Textual-free, which the usage and batch tests check by running it).
_MAY_IMPORT_TEXTUAL = {"mirage_tui", "mirage_tui.cli", "mirage_tui.__main__"}


def _module(path: Path) -> str:
    """``path``'s dotted name: a package is named by its folder."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_console_module_outside_the_app_is_forbidden_textual():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (listed,) = [set(c["source_modules"]) for c in contracts
                 if c["type"] == "forbidden" and "textual" in c["forbidden_modules"]
                 and any(m.startswith("mirage_tui.") for m in c["source_modules"])]
    # every module, subpackages' too, is covered: named, or inside a package the contract names
    app = ROOT / "mirage_tui" / "app"
    modules = {_module(p) for p in (ROOT / "mirage_tui").rglob("*.py") if app not in p.parents} - _MAY_IMPORT_TEXTUAL
    uncovered = {m for m in modules if not any(m == n or m.startswith(n + ".") for n in listed)}
    assert uncovered == set(), "add them to the forbidden contract in pyproject.toml"
    assert listed - modules == set(), "modules the contract names that are gone"


#: A module longer than this says why at its top ("Up to N lines on purpose: <why>") and stays under its N.
MODULE_LINES = 500
_STATED_LIMIT = re.compile(r"^Up to (\d+) lines on purpose: \S", re.M)


def _module_limits() -> dict[str, tuple[int, int | None]]:
    """Every module of the four packages: (its lines, the limit its docstring states or None)."""
    found = {}
    for package in ("wire", "emulator", "shim", "mirage_tui"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            doc = ast.get_docstring(ast.parse(text)) or ""
            stated = _STATED_LIMIT.search(doc)
            found[str(path.relative_to(ROOT))] = (text.count("\n"), int(stated.group(1)) if stated else None)
    return found


def test_a_long_module_says_why_and_stays_within_its_limit():
    over = {name: (lines, limit) for name, (lines, limit) in _module_limits().items()
            if lines > (limit if limit is not None else MODULE_LINES)}
    assert over == {}, (f"modules past their limit (lines, stated limit): {over}; split them, or say at the top "
                        f"'Up to N lines on purpose: <why>' (the default limit is {MODULE_LINES} lines)")


def test_a_stated_limit_is_a_reason_not_a_licence():
    # a limit far above what the module needs would let it grow unnoticed
    loose = {name: (lines, limit) for name, (lines, limit) in _module_limits().items()
             if limit is not None and (limit <= MODULE_LINES or limit > lines + 150)}
    assert loose == {}, f"stated limits that are not needed, or more than 150 lines above the module: {loose}"
