"""What a stub and the fork server say to each other over the server's Unix socket.

The stub sends one :class:`Handover` (JSON, length-prefixed) with its open
files attached (``SCM_RIGHTS``). The server answers with lines of text:
``pid <n>`` once it forked the rank, then ``exit <code>`` or ``signal <n>``
when the rank ended; or a single ``refuse <reason>`` when it cannot serve this
process, which then starts as a fresh interpreter. Standard library only: the
stub imports this before anything else.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import asdict, dataclass, field

ENV = "MIRAGE_FORK_SERVER"  # the server's socket path, in every process of a session that has one
SERVER_ENV = "MIRAGE_IS_FORK_SERVER"  # set in the server's own environment: its sitecustomize does nothing
MAX_FDS = 250  # the kernel passes at most 253 descriptors in one message (SCM_MAX_FD)
_LEN = struct.Struct("!I")
_MAX_BYTES = 16 << 20


@dataclass
class Stdio:
    """How the stub's interpreter set up one of its standard streams (the rank gets the same)."""

    encoding: str
    errors: str
    line_buffering: bool
    write_through: bool


@dataclass
class Handover:
    """Everything that makes a process the one it is, as far as a forked interpreter can take it over."""

    orig_argv: list[str]  # the interpreter's whole command line (sys.orig_argv)
    argv: list[str]  # sys.argv as the stub's interpreter set it before running the program
    executable: str
    prefix: str
    version: str
    flags: dict[str, int]  # sys.flags, by name
    xoptions: dict[str, str | bool]
    warnoptions: list[str]
    path: list[str]  # sys.path before the program's own entry (sys.path[0]) is added
    cwd: str
    umask: int
    env: dict[str, str]
    fds: list[int]  # the numbers of the descriptors attached, in order
    inheritable: list[bool]
    ignored_signals: list[int]  # signals the stub's parent left ignored (nohup's SIGHUP, a shell's '&')
    stdio: list[Stdio] = field(default_factory=list)  # stdin, stdout, stderr


def _recv_exact(sock: socket.socket, n: int, buf: bytes = b"") -> bytes:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the fork server's connection mid-message")
        buf += chunk
    return buf


def send_handover(sock: socket.socket, h: Handover, fds: list[int]) -> None:
    """Send ``h`` with descriptors ``fds`` attached."""
    body = json.dumps(asdict(h)).encode()
    socket.send_fds(sock, [_LEN.pack(len(body)) + body], fds)


def recv_handover(sock: socket.socket) -> tuple[Handover, list[int]]:
    """Receive a :class:`Handover` and the descriptors attached to it (now open in this process)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, MAX_FDS + 3)
    try:
        head = _recv_exact(sock, _LEN.size, data)
        (n,) = _LEN.unpack_from(head)
        if n > _MAX_BYTES:
            raise ValueError(f"a handover of {n} bytes (at most {_MAX_BYTES})")
        body = _recv_exact(sock, _LEN.size + n, head)[_LEN.size:]
        raw = json.loads(body)
        raw["stdio"] = [Stdio(**s) for s in raw.get("stdio", [])]
        return Handover(**raw), fds
    except BaseException:
        for fd in fds:
            _close(fd)
        raise


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
