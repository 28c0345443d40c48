"""The fork server: ``python -m forkserver.server SOCKET``, started by the session, one per machine.

It listens first (so that ranks started at once queue rather than miss it),
imports what every rank imports (:data:`PRELOAD`), freezes the garbage
collector's view of it (so that ranks do not copy those pages by touching
them), then serves: for each stub that connects it checks that a forked
interpreter would be the one the stub's command line asks for
(:func:`refusal`), forks, and reports the rank's end to its stub. The child
leaves :func:`serve` with its :class:`~forkserver.protocol.Handover` and
becomes that process (:mod:`forkserver.program`).

It ends on SIGTERM once its ranks have ended, and at once (taking its ranks
with it) when the session that started it is gone.
"""

from __future__ import annotations

import importlib.machinery
import os
import selectors
import signal
import socket
import struct
import sys

from forkserver.preload import PRELOAD, env_mismatch, preload
from forkserver.program import sys_path0
from forkserver.protocol import Handover, recv_handover

_IGNORED_FLAGS = ("unbuffered",)  # the rank's stdio is rebuilt as the stub's interpreter built it


def refusal(h: Handover, sys0: str | None) -> str | None:
    """Why a forked interpreter would not be the one ``h`` describes, or None if it would be."""
    if (os.path.realpath(h.executable), h.prefix, h.version) != (os.path.realpath(sys.executable), sys.prefix,
                                                                 sys.version):
        return f"another Python: {h.executable}"
    flags = {k: v for k, v in h.flags.items() if k not in _IGNORED_FLAGS}
    mine = {k: getattr(sys.flags, k) for k in flags}
    if flags != mine:
        diff = ", ".join(k for k in flags if flags[k] != mine[k])
        return f"interpreter options differ: {diff}"
    if h.xoptions != sys._xoptions or h.warnoptions != sys.warnoptions:
        return "-X or -W options differ"
    changed = env_mismatch(h.env)
    if changed is not None:
        return f"{changed} differs from the session's"
    path = ([sys0] if sys0 is not None else []) + h.path
    for name in sorted({n.partition(".")[0] for n in PRELOAD} | {"shim"}):
        if name in sys.modules and _origin(name, path) != sys.modules[name].__spec__.origin:
            return f"its sys.path finds another {name}"
    return None


def _origin(name: str, path: list[str]) -> str | None:
    """Where a process with ``path`` as its sys.path finds top-level package ``name``: on the path, else
    through the other finders the server has too (mirage's own editable install: the shim, wire)."""
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    for finder in sys.meta_path:
        if spec is not None:
            break
        if finder is not importlib.machinery.PathFinder and hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
    return spec.origin if spec is not None else None


class _Server:
    """The listening socket, the stubs waiting for their ranks, and the reaping of those ranks."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(1024)
        self.parent = os.getppid()
        self.stopping = False
        self.children: dict[int, socket.socket | None] = {}  # rank pid -> its stub's connection (None: gone)
        self.sel = selectors.DefaultSelector()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        self.wake_w = wake_w

    def arm(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the ranks via their stubs
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)

    def _stop(self, *_):
        self.stopping = True

    def loop(self) -> tuple[Handover, list[int], int, int] | None:
        """Serve until told to stop; in a forked rank, return what it is to become."""
        while not (self.stopping and not self.children):
            for key, _ in self.sel.select(timeout=1.0):
                if key.fileobj is self.listener:
                    job = self._accept()
                    if job is not None:
                        return job
                elif key.fileobj == self.wake_r:
                    self._drain()
                else:
                    self._stub_gone(key.fileobj)
            self._reap()
            if os.getppid() != self.parent:  # the session is gone: so are its ranks
                for pid in self.children:
                    _kill(pid, signal.SIGKILL)
                return None
            if self.stopping and self.listener.fileno() >= 0:
                self.sel.unregister(self.listener)
                self.listener.close()
        return None

    def _accept(self) -> tuple[Handover, list[int], int, int] | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        conn.settimeout(10.0)
        try:
            h, fds = recv_handover(conn)
        except (OSError, ValueError, TypeError, ConnectionError) as e:
            _reply(conn, f"refuse unreadable handover: {e}")
            conn.close()
            return None
        why = refusal(h, sys_path0(h))
        if why is not None:
            _reply(conn, f"refuse {why}")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        server = os.getpid()
        stub = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            self.sel.close()
            return h, fds, server, stub
        for fd in fds:
            os.close(fd)
        _reply(conn, f"pid {pid}")
        conn.settimeout(None)
        self.children[pid] = conn
        self.sel.register(conn, selectors.EVENT_READ)
        return None

    def _drain(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _stub_gone(self, conn) -> None:
        """A stub's connection spoke or closed: it was killed (SIGKILL cannot be forwarded); so is its rank."""
        self.sel.unregister(conn)
        for pid, c in self.children.items():
            if c is conn:
                _kill(pid, signal.SIGKILL)
                self.children[pid] = None
        conn.close()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
            _reply(conn, how)
            self.sel.unregister(conn)
            conn.close()


def _reply(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.replace("\n", " ").encode() + b"\n")
    except OSError:
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(path: str) -> tuple[Handover, list[int], int, int] | None:
    """Listen on ``path``, preload, serve; return only in a forked rank (what it becomes), or None at the end."""
    server = _Server(path)
    preload()
    server.arm()
    job = server.loop()
    if job is None:  # the server's end (a forked rank returns with its job)
        try:
            os.unlink(path)
        except OSError:
            pass
    return job


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m forkserver.server SOCKET")
    _job = serve(sys.argv[1])
    if _job is not None:
        from forkserver import program

        program.become(*_job)
        program.run(_job[0])
