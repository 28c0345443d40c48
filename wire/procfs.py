"""Whether a process still runs, read from ``/proc``: the daemon checks its ranks with it, a host's agent its own.

``os.kill(pid, 0)`` would count a zombie (exited, not yet reaped) as running.
"""

from __future__ import annotations


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
