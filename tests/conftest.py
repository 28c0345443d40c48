"""Shared pytest set-up for mirage's tests.

Kept minimal on purpose: fixtures that several test files need go here, each
in its own clearly marked section.
"""

import sys
from pathlib import Path

# ---------------------------------------------------------------- import path

#: The repository root; tests import ``emulator``, ``shim`` and ``mirage_tui``
#: from here even when the project is not pip-installed.
REPO_ROOT = Path(__file__).resolve().parent.parent

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------- orphans

import os  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402


def session_processes() -> list[str]:
    """Processes (other than this one) whose environment carries a mirage session id."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if "MIRAGE_SESSION" in p.environ():
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture
def no_orphans():
    """Fail the test if any process of a mirage session outlives it."""
    yield
    left = session_processes()
    assert not left, f"processes left behind: {left}"
