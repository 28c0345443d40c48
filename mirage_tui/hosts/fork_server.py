"""The session's fork server on this machine (:mod:`forkserver.server`): started before the command, stopped after.

Ranks find it through ``MIRAGE_FORK_SERVER`` (its socket in the run directory,
0600 in a 0700 folder); one that cannot be served starts as before. Its output
(an import that failed) is ``forkserver.log`` in the run directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mirage_tui.hosts.processes import die_with_starter, stop_child

SOCKET_NAME = "forkserver.sock"
LOG_NAME = "forkserver.log"
_LISTEN_WAIT_S = 10.0  # it listens before importing anything heavy: a few tens of ms


class ForkServer:
    """One fork server process: :meth:`start` returns once it listens; :meth:`stop` after the ranks ended."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, SOCKET_NAME)
        self.log = os.path.join(run_dir, LOG_NAME)
        self.proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> bool:
        """Start it with the environment of the session's processes; False (and nothing left running) if it
        did not come up, in which case ranks start as fresh interpreters."""
        env = {**env, "MIRAGE_IS_FORK_SERVER": "1"}
        env.pop("MIRAGE_FORK_SERVER", None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "forkserver.server", self.path], stdin=subprocess.DEVNULL, stdout=log,
                stderr=log, env=env, start_new_session=True, preexec_fn=die_with_starter(),
            )
        deadline = time.monotonic() + _LISTEN_WAIT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if os.path.exists(self.path):
                return True
            time.sleep(0.01)
        self.stop()
        return False

    def stop(self) -> None:
        """SIGTERM (it ends once its ranks have), then SIGKILL after the grace period (its ranks die with it)."""
        if self.proc is None:
            return
        stop_child(self.proc)
        try:
            os.unlink(self.path)
        except OSError:
            pass
