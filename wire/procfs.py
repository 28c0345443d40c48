"""Whether a process still runs, read from ``/proc``: the daemon checks its ranks with it, a host's agent its own.

``os.kill(pid, 0)`` would count a zombie (exited, not yet reaped) as running.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import TypeVar

#: Signals a launcher sends to tear the other ranks down once one has failed (torchrun's agent: SIGTERM).
TEARDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})

K = TypeVar("K")


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (its state first); None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != b"Z"


def ended(processes: Iterable[tuple[K, int]]) -> list[tuple[K, int]]:
    """The ``(key, pid)`` pairs whose process has ended, the likelier cause first.

    Found ended together (a launcher tears the others down milliseconds after one dies), one that died on
    its own or was killed comes before one whose exit status says a teardown signal ended it
    (:data:`TEARDOWN_SIGNALS`; ``/proc/PID/stat``'s last field, the status as ``waitpid`` gives it, readable
    until the parent reaps the process); one already reaped, whose status is unknown, between them.
    """
    found = [(key, pid, _stat(pid)) for key, pid in processes]
    found = [(key, pid, fields) for key, pid, fields in found if fields is None or fields[0] == b"Z"]
    if len(found) > 1:
        found.sort(key=lambda item: _cause_order(item[2]))
    return [(key, pid) for key, pid, _ in found]


def torn_down(pid: int) -> bool:
    """Whether process ``pid`` has ended by a teardown signal (:data:`TEARDOWN_SIGNALS`), as far as its zombie
    tells (False once reaped: unknown)."""
    fields = _stat(pid)
    return fields is not None and fields[0] == b"Z" and _cause_order(fields) == 2


def _cause_order(fields: list[bytes] | None) -> int:
    if fields is None:
        return 1
    status = int(fields[-1])
    return 2 if os.WIFSIGNALED(status) and os.WTERMSIG(status) in TEARDOWN_SIGNALS else 0
