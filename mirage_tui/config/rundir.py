"""The run directory: everything one run produced, private to the user (0700)."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

from mirage_tui.config.topology import UsageError

#: A unix socket's path must fit ``sun_path`` (108 bytes with its NUL); the daemon's longest is
#: ``<run dir>/events.sock`` (see ``wire.endpoints.endpoints``).
_MAX_SOCKET_PATH = 107
_LONGEST_SOCKET = "events.sock"


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


def create(log_dir: str | None, sockets: bool = True) -> RunDir:
    """Make ``<log_dir or .mirage/runs>/<timestamp>-<id>/`` with its ``ranks/`` folder and token.

    ``sockets``: the daemon will bind its ``ipc://`` sockets in it, so the path must be short enough.
    """
    root = os.path.abspath(log_dir or os.path.join(".mirage", "runs"))
    session = secrets.token_hex(4)
    path = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{session}")
    flag = f"--log-dir {log_dir}" if log_dir else f"the default run folder {root}"
    deepest = len(os.fsencode(os.path.join(path, _LONGEST_SOCKET)))
    if sockets and deepest > _MAX_SOCKET_PATH:
        room = _MAX_SOCKET_PATH - (deepest - len(os.fsencode(root)))
        raise UsageError(f"{flag}: too long for the daemon's sockets (a socket's path must stay under "
                         f"{_MAX_SOCKET_PATH + 1} bytes); pick a folder whose path has at most {room} bytes")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)
    except OSError as e:
        raise UsageError(f"{flag}: cannot create a run directory there ({e.strerror}); pick a writable folder") from None
    os.mkdir(os.path.join(path, "ranks"), 0o700)
    run = RunDir(path=path, session=session, token=secrets.token_hex(16))
    fd = os.open(run.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(run.token)
    return run
