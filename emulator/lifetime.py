"""The daemon's tie to its session: noticing the session is gone, and cleaning up after it.

The session (``mirage_tui/session/``) owns every process and normally stops
the daemon itself. If the session is SIGKILLed, the daemon notices
(:func:`orphaned`) and stops the ranks of that session it knows of
(:func:`stop_orphans`), so nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from wire.arena import session_segments
from wire.procfs import alive


def _of_session(pid: int, session: str) -> bool:
    """Whether process ``pid`` runs with ``MIRAGE_SESSION=<session>`` in its environment (as the session's sweep checks)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"MIRAGE_SESSION={session}".encode() in f.read().split(b"\0")
    except OSError:
        return False


_parent_signalled = False  # set by the parent-death signal, see die_with_parent


def orphaned(parent: int) -> bool:
    """Whether the session that started us (pid ``parent``) is gone, or dying (a zombie)."""
    # /proc is read only after the signal: this runs on every turn of the busy loop
    return os.getppid() != parent or (_parent_signalled and not alive(parent))


def _on_parent_death(signum, frame) -> None:
    global _parent_signalled
    _parent_signalled = True


def die_with_parent() -> None:
    """Arrange to learn of the session's death (see :func:`orphaned`)."""
    # Linux: SIGHUP us if the session dies without reaping us. The kernel sends it when the
    # *thread* that forked us exits, which, in a SIGKILLed session, can come before the
    # process is gone: the handler only notes it, and the loop checks orphaned() (a SIGTERM
    # here would stop us before we could tell, and skip stop_orphans). A SIGHUP whose parent
    # lives on (only the forking thread ended) changes nothing.
    signal.signal(signal.SIGHUP, _on_parent_death)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_orphans(session: str, rank_pids) -> None:
    """The session is gone: stop the ranks it left (they would wait on nobody; ``rank_pids`` as they
    registered) and remove the session's arenas."""
    # only processes that carry this session's id: a Hello's pid is the client's word, not proof
    pids = [pid for pid in rank_pids if pid > 1 and alive(pid) and _of_session(pid, session)]
    stopping = len(pids)
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while (pids := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
    for path in session_segments(session):
        try:
            os.unlink(path)
        except OSError:
            pass
    print(f"mirage daemon: the session went away; stopped {stopping} of its rank process(es)", file=sys.stderr,
          flush=True)
