"""Decide what this process is, capture its output, and arm the torch hook.

Run from ``sitecustomize`` before any user code. A process is one of:
- torchrun's agent: left alone (its lines reach the session as ``[node<n>]``);
- a rank (the first non-agent Python process of a node, or a torchrun worker):
  its output goes to the rank files, and torch is emulated once imported;
- a descendant of a rank (DataLoader workers, ``mp.spawn`` children): torch is
  emulated, output stays with the rank that started it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_torchrun_agent(argv: list[str]) -> bool:
    """True for ``torchrun ...`` and ``python -m torch.distributed.run ...``."""
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
        return True
    return any(a == "-m" and b in _AGENT_MODULES for a, b in zip(argv, argv[1:]))


class _ActivateAfterTorch(importlib.abc.MetaPathFinder):
    """Runs the emulation's activation right after ``import torch`` completes."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_activate(module):
            exec_module(module)
            from shim.activate import activate

            activate()

        spec.loader.exec_module = exec_then_activate
        return spec


def boot() -> None:
    """Entry point from sitecustomize."""
    if is_torchrun_agent(sys.orig_argv):
        return
    if "MIRAGE_RANK_PID" not in os.environ:
        os.environ["MIRAGE_RANK_PID"] = str(os.getpid())
        from shim.output import arm_stack_dumps, capture

        rank = int(os.environ.get("RANK", "0"))
        capture(os.environ["MIRAGE_RUN_DIR"], rank)
        arm_stack_dumps(os.environ["MIRAGE_RUN_DIR"], rank)
    if "torch" in sys.modules:
        from shim.activate import activate

        activate()
    else:
        sys.meta_path.insert(0, _ActivateAfterTorch())
