"""The run directory: everything one run produced, private to the user (0700)."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

from mirage_tui.topology import UsageError


@dataclass(frozen=True)
class RunDir:
    path: str
    session: str  # short hex id; names shared memory and tags processes
    token: str  # clients must present it to the daemon

    @property
    def ranks(self) -> str:
        return os.path.join(self.path, "ranks")

    @property
    def events(self) -> str:
        return os.path.join(self.path, "events.jsonl")

    @property
    def token_file(self) -> str:
        return os.path.join(self.path, "token")

    def rank_log(self, rank: int) -> str:
        return os.path.join(self.path, f"rank-{rank}.log")

    def node_log(self, node: int) -> str:
        return os.path.join(self.path, f"node-{node}.log")


def create(log_dir: str | None) -> RunDir:
    """Make ``<log_dir or .mirage/runs>/<timestamp>-<id>/`` with its ``ranks/`` folder and token."""
    root = os.path.abspath(log_dir or os.path.join(".mirage", "runs"))
    session = secrets.token_hex(4)
    path = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{session}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)
    except OSError as e:
        flag = f"--log-dir {log_dir}" if log_dir else f"the default run folder {root}"
        raise UsageError(f"{flag}: cannot create a run directory there ({e.strerror}); pick a writable folder") from None
    os.mkdir(os.path.join(path, "ranks"), 0o700)
    run = RunDir(path=path, session=session, token=secrets.token_hex(16))
    fd = os.open(run.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(run.token)
    return run
