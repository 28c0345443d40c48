"""Run code right after a module is imported: the shim's hooks on torch, dynamo, Triton, flex attention.

Some of what the shim adjusts lives in modules that cost time to import
(``torch._dynamo`` takes a second) or that a program may never import
(``triton``), or must be adjusted before a program takes names from them. One
finder at the front of ``sys.meta_path`` runs the hooks of a module right after
its body has run, before the importer gets it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_hooks: dict[str, list] = {}  # module name -> what runs once it is imported
_finding: set[str] = set()  # the names whose spec this finder is asking the others for


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
    if name in sys.modules:
        then()
        return
    _hooks.setdefault(name, []).append(then)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
