"""Send this rank's stdout/stderr straight to files in the run directory.

The kernel writes them, so nothing is lost if the rank is SIGKILLed; the
session tails the files, prefixes each line with the rank and logs it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

from shim.rank.runtime import RUNTIME
from wire.schema import STACK_SIGNAL


def rank_stream_path(run_dir: str, rank: int, stream: str) -> str:
    """Where rank ``rank``'s ``stream`` (stdout or stderr) is written."""
    return os.path.join(run_dir, "ranks", f"rank-{rank}.{stream}")


def capture(run_dir: str, rank: int) -> None:
    """Point fds 1 and 2 (and everything that inherits them) at the rank's files."""
    for f in (sys.stdout, sys.stderr):
        if f is not None:
            f.flush()  # what was printed before belongs where fds 1 and 2 pointed then
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        target = os.open(rank_stream_path(run_dir, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    for f in (sys.stdout, sys.stderr):
        if f is not None:
            f.reconfigure(line_buffering=True)


def arm_stack_dumps(run_dir: str, rank: int) -> None:
    """On ``STACK_SIGNAL``, append every thread's Python stack to ``rank-<r>.stacks``.

    faulthandler dumps from the signal handler in C, so a rank blocked inside a
    collective (or any C call) still answers.
    """
    # kept open for the life of the process (RUNTIME.stacks_file): faulthandler writes to its fd
    RUNTIME.stacks_file = stacks = open(rank_stream_path(run_dir, rank, "stacks"), "a")
    # Ignored underneath: faulthandler puts back the handler it found when the interpreter shuts
    # down, and a rank still tearing down when a hang report asks every rank for its stacks must
    # not die of the default action (its launcher would take that for a failure and kill its
    # peers). Not chained, for the same reason. A program that installs its own SIGUSR1 handler
    # later replaces this one (its choice); exec'd children start with the default action.
    signal.signal(STACK_SIGNAL, signal.SIG_IGN)
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
