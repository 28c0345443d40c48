"""Whether a process still runs, read from ``/proc``: the daemon checks its ranks with it, a host's agent its own.

``os.kill(pid, 0)`` would count a zombie (exited, not yet reaped) as running.
"""

from __future__ import annotations

import os
import signal

#: Signals a launcher sends to tear the other ranks down once one has failed (torchrun's agent: SIGTERM).
TEARDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def torn_down(pid: int) -> bool | None:
    """Whether zombie ``pid`` was ended by a teardown signal (:data:`TEARDOWN_SIGNALS`); None if not a zombie.

    ``/proc/PID/stat``'s last field is the exit status as ``waitpid`` gives it, readable until the parent
    reaps the process: among ranks found gone together, the one a launcher terminated is the effect.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != b"Z":
        return None
    status = int(fields[-1])
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) in TEARDOWN_SIGNALS


def cause_first(pid: int) -> int:
    """Sort key for processes found ended together: died on its own or killed (0), already reaped and
    unknown (1), terminated by a launcher's teardown (2) — the likelier cause first."""
    ended = torn_down(pid)
    return 1 if ended is None else 2 if ended else 0
