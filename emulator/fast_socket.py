"""The daemon's fast socket: ranks' small requests over a unix SOCK_SEQPACKET socket.

ZeroMQ moves each message through an I/O thread at either end (about 56 us a
round trip here, against 5 us for a bare unix socket), which dominated a small
collective's latency; so requests without data frames come here instead
(``wire.endpoints.FAST_SOCKET`` next to ``rpc.sock``), one datagram per request or
reply. This module owns the connections: accepting them, reading requests
(with the file descriptors a ``RegisterBuffer`` carries), queueing replies a
busy rank is not reading yet, and dropping a connection when its rank exits.
What a request means is the daemon's business: each one goes to the
``on_request`` callback it was given, under the connection's name.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
from collections import deque
from collections.abc import Callable

import numpy as np
import zmq

from wire import schema as s
from wire.endpoints import FAST_SOCKET

#: How a fast-socket connection is named where a ZeroMQ client's routing id would be: ZeroMQ's own
#: ids are 5 bytes starting with a zero byte and it refuses ids that a client sets starting with
#: one, so these (longer) names cannot collide with a ZeroMQ client's.
FAST_CLIENT = b"\x00fast:"
#: What the daemon's side of a fast connection may hold unsent (a reply larger than this is refused).
FAST_SNDBUF = 1 << 20
#: Room for the file descriptors one fast message may carry (RegisterBuffer sends one; a few more
#: are read only to be closed).
FAST_MAX_FDS = 4
#: Requests read from one connection per turn of the daemon's loop, so waves keep running under load.
READS_PER_TURN = 256
#: The poller's and recvmsg's flags as plain ints: ``int & zmq.POLLIN`` goes through
#: ``enum.Flag.__and__`` in Python, and these are tested on every request.
_POLLIN, _POLLOUT, _MSG_CTRUNC = int(zmq.POLLIN), int(zmq.POLLOUT), int(socket.MSG_CTRUNC)

#: ``on_request(client, data, fds)``: one request's bytes from connection ``client``, with the file
#: descriptors that came with it (the callback may use them while it runs; they are closed after).
OnRequest = Callable[[bytes, bytes, list[int]], None]
#: ``on_refuse(client, why)``: a datagram that is not a request (too long, too many descriptors).
OnRefuse = Callable[[bytes, str], None]
#: ``on_drop(client)``: the connection closed (its rank exited).
OnDrop = Callable[[bytes], None]


def is_fast(client: bytes) -> bool:
    """Whether ``client`` names a fast-socket connection (not a ZeroMQ routing id)."""
    return client.startswith(FAST_CLIENT)


class FastSocketServer:
    """The listening socket and its connections, registered with the daemon's poller."""

    def __init__(self, run_dir: str, poller: zmq.Poller, on_request: OnRequest, on_refuse: OnRefuse,
                 on_drop: OnDrop):
        path = os.path.join(run_dir, FAST_SOCKET)
        if os.path.exists(path):  # a previous daemon of this run directory left it
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.path = path
        self.poller = poller
        poller.register(self.listener, zmq.POLLIN)
        self.on_request, self.on_refuse, self.on_drop = on_request, on_refuse, on_drop
        self.conns: dict[bytes, socket.socket] = {}  # FAST_CLIENT name -> connection
        self.names: dict[socket.socket, bytes] = {}
        self.by_fd: dict[int, socket.socket] = {}  # the poller answers with file descriptors
        self.backlog: dict[bytes, deque[bytes]] = {}  # replies waiting for room, in order
        self._ids = itertools.count(1)  # names are never reused: a new process never gets old replies
        self._buf = bytearray(s.FAST_MAX_MESSAGE_BYTES + 1)  # +1: a longer request shows as too long
        self._anc = socket.CMSG_SPACE(FAST_MAX_FDS * 4)

    def ready(self, fd: int, flags: int) -> bool:
        """Handle what the poller reported for ``fd``; False if ``fd`` is not one of ours."""
        if fd == self.listener.fileno():
            self.accept()
            return True
        conn = self.by_fd.get(fd)
        if conn is None:
            return False
        if flags & _POLLOUT:
            self.flush(conn)
        if flags & _POLLIN and conn in self.names:  # (flush may have dropped it)
            self.read(conn)
        return True

    def reply(self, client: bytes, msg: s.Reply) -> None:
        """Send ``msg`` on a fast connection; behind earlier replies if those are still waiting for room."""
        conn = self.conns.get(client)
        if conn is None:
            return  # the rank is gone; the session reports it
        data = s.encode(msg)
        backlog = self.backlog.get(client)
        if backlog is not None:
            backlog.append(data)
            return
        try:
            conn.send(data)
        except BlockingIOError:  # the rank is not reading (busy in its own code): keep it for POLLOUT
            self.backlog[client] = deque([data])
            self.poller.modify(conn, zmq.POLLIN | zmq.POLLOUT)
        except OSError as e:
            if e.errno == errno.EMSGSIZE:  # still answered: the rank must not wait forever
                conn.send(s.encode(s.Error(req=msg.req, code="ncclInternalError",
                                           message=f"daemon reply of {len(data)} bytes too large for the fast socket")))
            # else the connection is gone; its rank will be reported dead by the session

    def accept(self) -> None:
        """Take new connections."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, FAST_SNDBUF)
            name = FAST_CLIENT + str(next(self._ids)).encode()
            self.conns[name] = conn
            self.names[conn] = name
            self.by_fd[conn.fileno()] = conn
            self.poller.register(conn, zmq.POLLIN)

    def read(self, conn: socket.socket) -> None:
        """Pass on the requests waiting on one connection (bounded, so waves keep running)."""
        name = self.names[conn]
        for _ in range(READS_PER_TURN):
            try:
                # recvmsg: a RegisterBuffer carries its storage's descriptor (SCM_RIGHTS); CLOEXEC so
                # that none leaks into a child, however briefly we hold it
                n, anc, flags, _ = conn.recvmsg_into([self._buf], self._anc, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError:
                n, anc, flags = 0, [], 0
            fds = _fds_of(anc)
            try:
                if n == 0:  # the rank closed it (exited)
                    return self.drop(conn)
                if n > s.FAST_MAX_MESSAGE_BYTES:
                    self.on_refuse(name, f"malformed request: longer than {s.FAST_MAX_MESSAGE_BYTES} bytes")
                    continue
                if flags & _MSG_CTRUNC:
                    self.on_refuse(name, f"malformed request: more than {FAST_MAX_FDS} file descriptors")
                    continue
                data = bytes(memoryview(self._buf)[:n])
                if b"\n" in data:  # several requests (a rank's deferred ones), a line each; never with fds
                    for line in data.split(b"\n"):
                        self.on_request(name, line, [])
                    continue
                self.on_request(name, data, fds)
            finally:
                for fd in fds:  # taken or not, the daemon keeps none (a mapping outlives its descriptor)
                    os.close(fd)

    def flush(self, conn: socket.socket) -> None:
        """Send a connection's waiting replies, as far as there is room."""
        name = self.names[conn]
        backlog = self.backlog[name]
        while backlog:
            try:
                conn.send(backlog[0])
            except BlockingIOError:
                return
            except OSError:
                break
            backlog.popleft()
        del self.backlog[name]
        self.poller.modify(conn, zmq.POLLIN)

    def drop(self, conn: socket.socket) -> None:
        """Forget a connection (its rank exited, or the daemon is closing)."""
        self.poller.unregister(conn)
        name = self.names.pop(conn)
        self.on_drop(name)
        del self.by_fd[conn.fileno()]
        self.conns.pop(name, None)
        self.backlog.pop(name, None)
        conn.close()

    def close(self) -> None:
        """Drop every connection and remove the socket file."""
        for conn in list(self.names):
            self.drop(conn)
        self.poller.unregister(self.listener)
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _fds_of(anc: list) -> list[int]:
    """The file descriptors among a message's ancillary data (SCM_RIGHTS), now ours to close."""
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(np.frombuffer(data[: len(data) - len(data) % 4], np.int32).tolist())
    return fds
