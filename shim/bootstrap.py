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

from shim.clock import program_clock
from shim.comm import registration
from shim.compile import triton_runtime
from shim.import_hooks import after_import
from shim.rank.runtime import RUNTIME

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

    from shim.device import state  # noqa: F401 - it registers the device state on the runtime

    count = RUNTIME.device.count
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
    if rank is None and RUNTIME.settings.num_nodes == 1:
        rank = os.environ.get("LOCAL_RANK")
    if rank is None or not rank.isdigit() or rank == RUNTIME.settings.claimed_rank:
        return None
    return int(rank)


def boot() -> None:
    """Entry point from sitecustomize."""
    if is_torchrun_agent(sys.orig_argv):
        _after_torch(_count_gpus_in_agent)
        return
    triton_runtime.prepare()  # before user code: @triton.jit picks the interpreter as it decorates
    settings = RUNTIME.settings
    if settings.exec_probe:
        # 'mirage exec': a probe beside the job, not a rank: its output is its own, it claims no rank
        _after_torch(_activate)
        return
    child = _launched_rank() if settings.rank_pid is not None else None
    if settings.rank_pid is None or child is not None:
        # for this process's descendants: the settings keep what it inherited
        os.environ["MIRAGE_RANK_PID"] = str(os.getpid())
        from shim.rank.output import arm_stack_dumps, capture

        rank = int(os.environ.get("RANK", "0")) if child is None else child
        RUNTIME.claim(rank)
        os.environ[registration.CLAIMED] = str(rank)
        capture(settings.run_dir, rank)
        arm_stack_dumps(settings.run_dir, rank)
        program_clock.install()  # --program-clock emulated: before the program's code captures a clock
        if settings.debug_rank == str(rank):  # --debug-rank: stop before the program runs
            from shim.rank.debugger import wait_for_debugger

            wait_for_debugger(rank)
    _after_torch(_activate)
