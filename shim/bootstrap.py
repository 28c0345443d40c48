"""Decide what this process is, capture its output, and arm the torch hook.

Run from ``sitecustomize`` before any user code. A process is one of:
- torchrun's agent: only counts the node's emulated GPUs (``--nproc_per_node=gpu``
  or ``auto``); its lines reach the session as ``[node<n>]``;
- a rank (the first non-agent Python process of a node, or a torchrun worker):
  its output goes to the rank files, and torch is emulated once imported (the
  rank ``--debug-rank`` names waits for a debugger first: ``shim.rank.debugger``);
- a rank another launcher started inside a rank's process (``accelerate
  launch``'s torchrun workers: ``RANK``; Lightning's children on one node:
  ``LOCAL_RANK``; either not the rank their parent claimed): a rank from the
  start, as a torchrun worker;
- another descendant of a rank (DataLoader workers, ``mp.spawn`` children): torch is
  emulated, output stays with the rank that started it until it forms a world
  of its own (``shim.comm.world`` then claims the rank ``init_process_group`` gives it).
"""

from __future__ import annotations

import os
import sys

from shim.comm import registration
from shim.compile import triton_runtime
from shim.import_hooks import after_import

_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_torchrun_agent(argv: list[str]) -> bool:
    """True for ``torchrun ...`` and ``python -m torch.distributed.run ...``."""
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
        return True
    return any(a == "-m" and b in _AGENT_MODULES for a, b in zip(argv, argv[1:]))


def _activate() -> None:
    from shim.activate import activate

    activate()


def _count_gpus_in_agent() -> None:
    """torchrun's agent answers ``torch.cuda``/``torch.accelerator``'s counts with the node's emulated GPUs."""
    import torch

    from shim.device.state import STATE

    count = STATE.count
    torch.cuda.is_available = lambda: count > 0
    torch.cuda.device_count = lambda: count
    torch.accelerator.is_available = lambda: count > 0
    torch.accelerator.device_count = lambda: count
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda") if count else None


def _after_torch(then) -> None:
    after_import("torch", then)


def _launched_rank() -> int | None:
    """The rank of a rank's descendant that a launcher started as another rank; None for any other descendant.

    torchrun run inside a rank's process (``accelerate launch`` does) gives its workers ``RANK``; Lightning
    gives its children ``LOCAL_RANK`` (no ``RANK``), which on a one-node run is the rank. DataLoader workers
    and ``mp.spawn`` children inherit their parent's (the rank it claimed) or none.
    """
    rank = os.environ.get("RANK")
    if rank is None and os.environ.get("MIRAGE_NUM_NODES", "1") == "1":
        rank = os.environ.get("LOCAL_RANK")
    if rank is None or not rank.isdigit() or rank == os.environ.get(registration.CLAIMED):
        return None
    return int(rank)


def boot() -> None:
    """Entry point from sitecustomize."""
    if is_torchrun_agent(sys.orig_argv):
        _after_torch(_count_gpus_in_agent)
        return
    triton_runtime.prepare()  # before user code: @triton.jit picks the interpreter as it decorates
    if os.environ.get("MIRAGE_EXEC") == "1":
        # 'mirage exec': a probe beside the job, not a rank: its output is its own, it claims no rank
        _after_torch(_activate)
        return
    child = _launched_rank() if "MIRAGE_RANK_PID" in os.environ else None
    if "MIRAGE_RANK_PID" not in os.environ or child is not None:
        os.environ["MIRAGE_RANK_PID"] = str(os.getpid())
        from shim.rank.output import arm_stack_dumps, capture

        rank = registration.RANK = int(os.environ.get("RANK", "0")) if child is None else child
        os.environ[registration.CLAIMED] = str(rank)
        capture(os.environ["MIRAGE_RUN_DIR"], rank)
        arm_stack_dumps(os.environ["MIRAGE_RUN_DIR"], rank)
        if os.environ.get("MIRAGE_DEBUG_RANK") == str(rank):  # --debug-rank: stop before the program runs
            from shim.rank.debugger import wait_for_debugger

            wait_for_debugger(rank)
    _after_torch(_activate)
