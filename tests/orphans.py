"""Finding what a test's mirage sessions left running (``no_orphans`` in conftest.py, test_tui.py).

A module of its own, not conftest.py: ``tests/reliability`` has a conftest too,
and ``from conftest import`` would get whichever pytest imported first.
"""

import os

import psutil


def session_processes(sessions: set[str]) -> list[str]:
    """Processes (other than this one) whose environment carries one of ``sessions``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("MIRAGE_SESSION") in sessions:
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (psutil.Error, OSError):
            continue
    return found
