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

A rank's mutable state hangs off its runtime (``shim.rank.runtime.RUNTIME``):
a scan of the shim's modules fails on any other module-level name bound to a
mutable value, or rebound with ``global``, that ``[tool.mirage.module-state]``
in ``pyproject.toml`` does not declare, and on a module body that reads the
runtime as it loads instead of handing it a builder.
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


#: Calls whose result cannot be changed in place: a module-level name bound to one is a constant.
_IMMUTABLE_CALLS = {"frozenset", "tuple", "int", "float", "str", "bytes", "bool", "MappingProxyType", "Struct",
                    "compile", "device", "Path", "with_name", "dirname", "join", "abspath", "TypeVar", "NewType",
                    "namedtuple", "DispatchKeySet"}
_MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
#: The one name that holds a rank's mutable state.
_THE_RUNTIME = "shim.rank.runtime.RUNTIME"


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _module_state(source: str) -> set[str]:
    """The module-level names ``source`` binds to a mutable value (a dict, list or set display or
    comprehension, a call to anything but :data:`_IMMUTABLE_CALLS`) or rebinds with ``global``."""
    tree = ast.parse(source)
    found = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        called = isinstance(value, ast.Call) and _callee(value) not in _IMMUTABLE_CALLS
        if isinstance(value, _MUTABLE_NODES) or called:
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def _declared_state() -> dict[str, str]:
    """``[tool.mirage.module-state]``: every declared name -> its kind."""
    kinds = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mirage"]["module-state"]
    return {name: kind for kind, names in kinds.items() for name in names}


def test_a_rank_s_mutable_state_is_on_its_runtime():
    declared = _declared_state()
    found = {f"{_module(path)}.{name}" for path in sorted((ROOT / "shim").rglob("*.py"))
             for name in _module_state(path.read_text())}
    undeclared = sorted(found - set(declared) - {_THE_RUNTIME})
    assert undeclared == [], (
        f"module-level mutable state in the shim: {undeclared}; put it on the rank's runtime (a field of "
        f"shim.rank.runtime.Runtime, or an object of its layer that RUNTIME.attach builds), or declare it as a "
        f"constant, cache, handle, thread-local or registry, with why, in pyproject.toml's "
        f"[tool.mirage.module-state] (docs/architecture.md, \"A rank's runtime\")")
    assert sorted(set(declared) - found) == [], "declared in [tool.mirage.module-state] but gone: remove them"


def test_the_state_check_sees_new_module_state():
    source = "import threading\nA = {}\nB = frozenset({1})\nC = threading.Lock()\nD = [i for i in ()]\nE = None\n" \
             "def f():\n    global E\n    E = 1\n"
    assert _module_state(source) == {"A", "C", "D", "E"}


def test_nothing_builds_rank_state_as_a_module_loads_but_through_the_runtime():
    # a module's body may hand RUNTIME a builder (RUNTIME.attach), which a rebuilt runtime runs again; what it
    # reads of RUNTIME itself at import would stay the first rank's
    reads = []
    for path in sorted((ROOT / "shim").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                continue
            attach = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                      and ast.unparse(node.value.func) == "RUNTIME.attach")
            if not attach and any(isinstance(n, ast.Name) and n.id == "RUNTIME" for n in ast.walk(node)):
                reads.append(f"{_module(path)}:{node.lineno}")
    assert reads == [_THE_RUNTIME.rsplit(".", 1)[0] + ":" + str(_runtime_line())], (
        f"module bodies that read the rank's runtime as they load: {reads}; build per-rank state in a function "
        f"given to RUNTIME.attach, or read RUNTIME where it is used")


def _runtime_line() -> int:
    tree = ast.parse((ROOT / "shim/rank/runtime.py").read_text())
    (line,) = [n.lineno for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "RUNTIME"]
    return line


_REBUILD = """
import os
import torch
torch.utils.rename_privateuse1_backend("mirage")  # as activation does first
import shim.comm.world, shim.comm.c10d_patches, shim.cuda.mode, shim.memory.pinned, shim.transport.direct
from shim.rank.runtime import RUNTIME
from shim.rank.settings import Settings

first = (RUNTIME.device, RUNTIME.allocator, RUNTIME.cuda, RUNTIME.comm, RUNTIME.device.generators)
assert RUNTIME.device.count == 2 and len(RUNTIME.allocator.devices) == 2, RUNTIME.device
RUNTIME.once.first("activate")
os.environ.update(MIRAGE_GPUS_PER_NODE="4", MIRAGE_INJECT="rank=1,seq=3,action=crash")
RUNTIME.rebuild(Settings.from_environ())
again = (RUNTIME.device, RUNTIME.allocator, RUNTIME.cuda, RUNTIME.comm, RUNTIME.device.generators)
assert all(a is not b for a, b in zip(first, again)), "an object survived the rebuild"
assert RUNTIME.device.count == 4 and len(RUNTIME.allocator.devices) == 4 and len(RUNTIME.device.generators) == 4
assert [f.rank for f in RUNTIME.comm.planned] == [1] and not RUNTIME.once.done
print("rebuilt")
"""


def test_a_runtime_rebuilt_for_another_rank_has_its_own_state():
    # what a fork server needs: import once, then a fresh runtime from the forked rank's own environment
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_")}
    env.update(PYTHONPATH=str(ROOT), MIRAGE_GPUS_PER_NODE="2")
    done = subprocess.run([sys.executable, "-c", _REBUILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "rebuilt" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
