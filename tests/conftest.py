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
import re  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

# The tests see the bundled GPU profiles only: profiles a user made in ~/.config/mirage/profiles
# would change listings and error messages. An empty folder, which every subprocess inherits.
os.environ["XDG_CONFIG_HOME"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mirage-test-config-{os.getpid()}")

from orphans import session_processes  # noqa: E402

_RUN_DIR = re.compile(r"^\d{8}-\d{6}-([0-9a-f]{8})$")


@pytest.fixture
def no_orphans(tmp_path):
    """Fail the test if any process of a session it ran (run dirs under tmp_path) outlives it."""
    yield
    sessions = {m.group(1) for d in tmp_path.rglob("*") if (m := _RUN_DIR.match(d.name))}
    left = session_processes(sessions)
    if left:  # give processes that are mid-exit a moment, then look again
        time.sleep(2)
        left = session_processes(sessions)
    assert not left, f"processes left behind: {left}"
    shm = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"mirage-{s}-") for s in sessions)]
    assert not shm, f"shared memory left behind: {shm}"


# ---------------------------------------------------------------- a daemon

@pytest.fixture(scope="module")
def daemon():
    """A real ``python -m emulator`` daemon shared by a test module; it must leave no arena behind."""
    from daemon_client import DaemonProcess

    from wire.arena import session_segments

    d = DaemonProcess()
    try:
        yield d
    finally:
        d.stop()
        assert not session_segments(d.session)
