"""Run code right after a module is imported: the shim's hooks on torch, dynamo, Triton, flex attention.

Some of what the shim adjusts lives in modules that cost time to import
(``torch._dynamo`` takes a second) or that a program may never import
(``triton``), or must be adjusted before a program takes names from them. One
finder at the front of ``sys.meta_path`` runs the hooks of a module right after
its body has run, before the importer gets it.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.util
import sys

_hooks: dict[str, list] = {}  # module name -> what runs once it is imported
_finding: set[str] = set()  # the names whose spec this finder is asking the others for
#: packages a fork server imported before this process became a rank (forkserver.program), which the
#: program has not imported yet: their hooks wait for its first import of them, as in a fresh interpreter
_preloaded: dict[str, list] = {}  # top-level package -> [(module name, hook)]


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _hooks or name in _finding:
            return None
        _finding.add(name)
        try:
            spec = importlib.util.find_spec(name)  # the other finders' (a find_spec alone imports nothing:
        finally:  # the hooks wait for the import itself, as torch's has_triton_package only looks)
            _finding.discard(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            for then in _hooks.pop(name, ()):
                then()
            if not _hooks and _finder in sys.meta_path:
                sys.meta_path.remove(_finder)

        spec.loader.exec_module = exec_then
        return spec


_finder = _AfterImport()


def after_import(name: str, then) -> None:
    """Run ``then()`` once module ``name`` is imported: now if it is, else right after its import."""
    top = name.partition(".")[0]
    if top in _preloaded:
        _preloaded[top].append((name, then))
        return
    if name in sys.modules:
        then()
        return
    _hooks.setdefault(name, []).append(then)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def wait_for_program(packages) -> None:
    """Hooks on ``packages`` (imported already, by the fork server) run at the program's first import of them.

    A fresh rank runs the hook on ``torch`` (the shim's activation) when the program imports torch, after
    what the program did first (e.g. set ``CUDA_VISIBLE_DEVICES``); a forked one finds torch imported, so
    the first ``import`` statement (or ``importlib.import_module``) naming one of them runs their hooks.
    """
    for top in packages:
        _preloaded.setdefault(top, [])
    plain_import, import_module = builtins.__import__, importlib.import_module

    def first_import(name: str) -> None:
        top = name.partition(".")[0]
        if top not in _preloaded:
            return
        waiting = _preloaded.pop(top)
        if not _preloaded:
            builtins.__import__, importlib.import_module = plain_import, import_module
        for module, then in waiting:
            after_import(module, then)

    def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            first_import(name)
        return plain_import(name, globals, locals, fromlist, level)

    def watching_import_module(name, package=None):
        if not name.startswith("."):
            first_import(name)
        return import_module(name, package)

    builtins.__import__, importlib.import_module = watching_import, watching_import_module
