"""Send this rank's stdout/stderr straight to files in the run directory.

The kernel writes them, so nothing is lost if the rank is SIGKILLed; the
session tails the files, prefixes each line with the rank and logs it.
"""

from __future__ import annotations

import os
import sys


def rank_stream_path(run_dir: str, rank: int, stream: str) -> str:
    """Where rank ``rank``'s ``stream`` (stdout or stderr) is written."""
    return os.path.join(run_dir, "ranks", f"rank-{rank}.{stream}")


def capture(run_dir: str, rank: int) -> None:
    """Point fds 1 and 2 (and everything that inherits them) at the rank's files."""
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        target = os.open(rank_stream_path(run_dir, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    for f in (sys.stdout, sys.stderr):
        if f is not None:
            f.reconfigure(line_buffering=True)
