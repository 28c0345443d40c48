"""The rank's connection to the daemon: requests over its fast unix socket or ZeroMQ, data through
its arena or as frames.

The shared-memory transport stages a collective's bytes in the rank's arena;
the socket transport (NCCL's NET/Socket: ranks on different emulated nodes,
or P2P and SHM disabled) sends them as ZeroMQ data frames after the request
and gets the output back as a frame after the reply.
"""

from __future__ import annotations

import array
import itertools
import os
import socket
import threading
import time

import torch
import torch.distributed as dist
import zmq

from wire import schema as s
from wire.arena import Arena, arena_name
from wire.endpoints import fast_socket_path

_ALIGN = 64
#: How often a rank waiting for a reply checks that the daemon still runs.
DAEMON_CHECK_S = 0.25
#: How long a deferred request may wait before it is sent (see ``DaemonClient.defer``): well under
#: the daemon's straggler margin (0.25 s), whose arrival times it shifts.
DEFER_MAX_S = 0.02


class DaemonGone(dist.DistBackendError):
    """The daemon exited: no reply will ever come (raised instead of waiting out the timeout)."""


def _pid_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited).

    Not ``wire.procfs.alive``: a ``/proc`` entry that cannot be read for another reason counts as still
    there, since a daemon wrongly taken for dead would fail a rank's collective that was about to finish."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def curve_client(sock: zmq.Socket, server_key: str) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_key`` (Z85), with a key pair
    of its own; the token it sends is then never in clear on the network."""
    if not server_key:
        raise DaemonGone("mirage: MIRAGE_SERVER_KEY is not set; a daemon over TCP needs its public key")
    sock.curve_serverkey = server_key.encode()
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()


def _connect_fast(endpoint: str) -> socket.socket | None:
    """The daemon's fast socket (``wire.endpoints.FAST_SOCKET``, next to its ``ipc://`` endpoint), or None."""
    if not endpoint.startswith("ipc://"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(fast_socket_path(endpoint))
    except OSError:
        sock.close()
        return None
    return sock


class DaemonClient:
    """A process's connection to the daemon, shared by threads and by requests in flight.

    Two channels: the daemon's unix SOCK_SEQPACKET socket for requests without
    data frames whose transport is shared memory (every message one syscall
    each way, no I/O threads), and a ZeroMQ DEALER socket for the rest (the
    socket transport's data frames), or for everything when the fast socket
    cannot be reached. A communicator's collectives all take the same channel,
    so the daemon sees them in the order they were posted.

    Replies can come back in any order (a receive posted before a collective
    may finish after it): whoever reads a reply that is not theirs leaves it
    in the channel's stash for its owner, and the data frame that came with it
    in ``_data``.
    """

    def __init__(self, endpoint: str, token: str, session: str, tag: str, daemon_pid: int = 0, *,
                 server_key: str = "", run_dir: str = ""):
        self.token = token
        self.run_dir = run_dir  # where daemon.log is, for the message when the daemon is gone
        self.daemon_pid = daemon_pid  # 0: unknown, never checked
        self.session = session
        self.tag = tag
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://"):  # a daemon on another host: CURVE, as it listens (emulator.daemon)
            curve_client(self._sock, server_key)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stash: dict[int, s.Reply] = {}
        self._fast = _connect_fast(endpoint)
        # sends go through a second socket object on the same connection: a reader changes its own
        # object's timeout (0 to poll), which must not make a concurrent send give up
        self._fast_tx = None if self._fast is None else socket.socket(fileno=os.dup(self._fast.fileno()))
        if self._fast_tx is not None:
            self._fast_tx.settimeout(DAEMON_CHECK_S)
        # guards the fast stash; one thread at a time reads the socket (without the lock) and wakes
        # the others when it stashes a reply, so a thread waiting on the socket never holds anyone up
        self._fast_cond = threading.Condition(threading.Lock())
        self._fast_reading = False
        self._fast_stash: dict[int, s.Reply | None] = {}  # req -> its reply; None: sent, not answered yet
        self._fast_buf = bytearray(s.FAST_MAX_MESSAGE_BYTES + 1)  # +1: a longer message shows as too long
        self._data: dict[int, zmq.Frame] = {}
        # deferred requests (encoded, in order) and when the oldest was deferred; the condition also
        # orders fast sends: deferred requests go out before any later one
        self._defer_cond = threading.Condition(threading.Lock())
        self._deferred: list[bytes] = []
        self._deferred_bytes = 0
        self._deferred_since = 0.0
        self._flusher: threading.Thread | None = None
        self._pid = os.getpid()  # a forked child must not send its parent's deferred requests
        self._arena: Arena | None = None
        self._generation = 0
        self._scratch = itertools.count(1)

    @property
    def has_fast(self) -> bool:
        """Whether requests go over the fast socket (the only one that can carry file descriptors)."""
        return self._fast is not None

    def send(self, msg: s.Request, data: memoryview | None = None, fds: list[int] | None = None,
             reply: bool = True) -> int:
        """Send ``msg`` (token and id filled in), and ``data`` as its data frames; return the reply's id.

        ``data`` is sent without copying it (large frames) and this returns once
        ZeroMQ is done reading it, so the caller may change it afterwards, as
        after staging it into an arena. ``fds`` go with the message as
        SCM_RIGHTS (fast socket only; the caller keeps its own copies). With
        ``reply`` False nobody will wait for the answer: it is dropped on arrival.
        """
        req = next(self._ids)
        head = s.encode(msg, token=self.token, req=req)
        if fds and (self._fast is None or data is not None or len(head) > s.FAST_MAX_MESSAGE_BYTES):
            raise ValueError("file descriptors travel only on the fast socket, without data frames")
        if (
            self._fast is not None and data is None and len(head) <= s.FAST_MAX_MESSAGE_BYTES
            and getattr(msg, "transport", s.Transport.SHM) is not s.Transport.SOCKET
        ):
            if reply:
                with self._fast_cond:
                    self._fast_stash[req] = None
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else None
            with self._defer_cond:
                if self._deferred:
                    self._flush_locked()
                self._send_fast(head, anc)
            return req
        step = s.MAX_DATA_FRAME_BYTES
        frames = [data[i : i + step] for i in range(0, len(data), step)] if data is not None else []
        trackers = []
        with self._lock:
            self._sock.send(head, zmq.SNDMORE if frames else 0)
            for i, frame in enumerate(frames):
                # pyzmq copies small frames anyway (their tracker is done at once)
                trackers.append(self._sock.send(frame, zmq.SNDMORE if i + 1 < len(frames) else 0, copy=False,
                                                track=True))
        for tracker in trackers:
            while True:
                try:
                    tracker.wait(DAEMON_CHECK_S)
                    break
                except zmq.NotDone:
                    self.check_daemon()
        return req

    def _send_fast(self, data: bytes, anc: list | None = None) -> None:
        """One datagram on the fast socket, waiting for room while the daemon lives."""
        while True:
            try:
                if anc is None:
                    self._fast_tx.send(data)
                else:
                    self._fast_tx.sendmsg([data], anc)
                return
            except TimeoutError:  # the daemon is busy (a long wave) and its queue is full: wait on
                self.check_daemon()
            except OSError:
                raise self._gone() from None

    def defer(self, msg: s.Request, reply: bool = True) -> int:
        """Queue ``msg`` for the daemon without sending it now; return its id, to ``wait`` or ``poll`` on as any.

        For requests only answered when something is wrong (rank-to-rank
        collectives), or never (``reply`` False: clocked mode's step reports):
        deferred requests go out together, as one datagram of lines, within
        ``DEFER_MAX_S`` (a thread sees to it), before any later request, or at
        :meth:`flush` (before a rank blocks, at exit). Their order is kept.
        Needs the fast socket (:attr:`has_fast`).
        """
        req = next(self._ids)
        line = s.encode(msg, token=self.token, req=req)
        if reply:
            with self._fast_cond:
                self._fast_stash[req] = None
        with self._defer_cond:
            if self._deferred and (
                self._deferred_bytes + len(line) + 1 > s.FAST_MAX_MESSAGE_BYTES
                or time.monotonic() - self._deferred_since > DEFER_MAX_S  # (the thread may not get the GIL)
            ):
                self._flush_locked()
            if not self._deferred:
                self._deferred_since = time.monotonic()
                if self._flusher is None:
                    self._flusher = threading.Thread(target=self._flush_later, name="mirage-defer", daemon=True)
                    self._flusher.start()
                self._defer_cond.notify()
            self._deferred.append(line)
            self._deferred_bytes += len(line) + 1
        return req

    def flush(self) -> None:
        """Send the deferred requests now (dropped if the daemon is gone: nobody keeps the books then)."""
        # (not in a forked child: they are its parent's, and the lock may have been held by a thread
        # the child does not have)
        if self._deferred and os.getpid() == self._pid:
            with self._defer_cond:
                try:
                    self._flush_locked()
                except DaemonGone:
                    pass

    def _flush_locked(self) -> None:
        if not self._deferred or os.getpid() != self._pid:
            return
        data = b"\n".join(self._deferred)
        self._deferred, self._deferred_bytes = [], 0
        self._send_fast(data)

    def _flush_later(self) -> None:
        """The flusher thread: sends deferred requests once the oldest is ``DEFER_MAX_S`` old."""
        with self._defer_cond:
            while True:
                if not self._deferred:
                    self._defer_cond.wait()
                    continue
                left = self._deferred_since + DEFER_MAX_S - time.monotonic()
                if left > 0:
                    self._defer_cond.wait(left)
                    continue
                try:
                    self._flush_locked()
                except DaemonGone:
                    return

    def _gone(self) -> DaemonGone:
        return DaemonGone(
            f"mirage: the emulator daemon (pid {self.daemon_pid or '?'}) is gone, so no collective can complete; "
            f"see {os.path.join(self.run_dir or '.', 'daemon.log')}"
        )

    def check_daemon(self) -> None:
        """Raise :class:`DaemonGone` once the daemon's process has exited."""
        if self.daemon_pid and _pid_gone(self.daemon_pid):
            raise self._gone()

    def _read_fast(self, timeout_s: float) -> bool:
        """Read one message from the fast socket into its stash; False on timeout.

        Called with ``_fast_cond`` held and ``_fast_reading`` set by the caller;
        the lock is let go while the read blocks.
        """
        self._fast_cond.release()
        try:
            self._fast.settimeout(timeout_s)
            n = self._fast.recv_into(self._fast_buf)
            got = s.decode(bytes(memoryview(self._fast_buf)[:n])) if n else None
        except (TimeoutError, BlockingIOError):  # BlockingIOError: a poll, with timeout 0
            return False
        except OSError:
            raise self._gone() from None
        except s.SchemaError:
            return True  # the daemon only sends what it encoded; nothing to hand anyone
        finally:
            self._fast_cond.acquire()
        if got is None:  # the daemon closed the connection: it exited
            raise self._gone()
        if isinstance(got, s.Reply) and got.req in self._fast_stash:
            self._fast_stash[got.req] = got
            self._fast_cond.notify_all()  # it may be another thread's
        return True

    def _wait_fast(self, req: int, timeout_s: float) -> s.Reply:
        """``wait`` for a request sent on the fast socket: a blocking read, woken by the reply itself."""
        deadline = time.monotonic() + timeout_s
        with self._fast_cond:
            while True:
                reply = self._fast_stash.get(req)
                if reply is not None:
                    del self._fast_stash[req]
                    return reply
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply from the mirage daemon within {timeout_s:.0f} s")
                # bounded, so that a dead daemon is noticed
                if self._fast_reading:  # another thread reads; it wakes us when it stashes a reply
                    self._fast_cond.wait(min(left, DAEMON_CHECK_S))
                    continue
                self._fast_reading = True
                try:
                    read = self._read_fast(min(left, DAEMON_CHECK_S))
                finally:
                    self._fast_reading = False
                    self._fast_cond.notify()  # someone else may read now
                if not read:
                    self.check_daemon()

    def _read(self) -> s.Reply | None:
        """Read one message (lock held): the reply, its data frame set aside in ``_data``."""
        got = s.decode(self._sock.recv())
        frame = self._sock.recv(copy=False) if self._sock.get(zmq.RCVMORE) else None
        while self._sock.get(zmq.RCVMORE):  # the daemon sends one data frame at most; drop anything else
            self._sock.recv()
        if not isinstance(got, s.Reply):
            return None
        if frame is not None:
            self._data[got.req] = frame
        return got

    def data(self, req: int) -> memoryview | None:
        """The data frame that came with the reply to ``req`` (socket transport), taken; None if none came."""
        with self._lock:
            frame = self._data.pop(req, None)
        return None if frame is None else frame.buffer

    def wait(self, req: int, timeout_s: float = 60.0) -> s.Reply:
        """The reply to request ``req``, once it comes (TimeoutError after ``timeout_s``)."""
        if req in self._fast_stash:
            return self._wait_fast(req, timeout_s)
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + DAEMON_CHECK_S
        while True:
            if self.daemon_pid and time.monotonic() >= next_check:
                next_check = time.monotonic() + DAEMON_CHECK_S
                self.check_daemon()
            with self._lock:
                reply = self._stash.pop(req, None)
                if reply is not None:
                    return reply
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply from the mirage daemon within {timeout_s:.0f} s")
                # short polls: another thread may be waiting for a reply this one reads
                if self._sock.poll(min(left, 0.05) * 1000):
                    got = self._read()
                    if got is not None:
                        if got.req == req:
                            return got
                        self._stash[got.req] = got

    def poll(self, req: int) -> bool:
        """Whether the reply to ``req`` has arrived (reads what is waiting, never blocks)."""
        if req in self._fast_stash:
            with self._fast_cond:
                if not self._fast_reading:  # else the reading thread stashes it
                    self._fast_reading = True
                    try:
                        while self._fast_stash.get(req) is None and self._read_fast(0.0):
                            pass
                    finally:
                        self._fast_reading = False
                        self._fast_cond.notify()
                return self._fast_stash.get(req) is not None
        with self._lock:
            while self._sock.poll(0):
                got = self._read()
                if got is not None:
                    self._stash[got.req] = got
            return req in self._stash

    def forget(self, req: int) -> None:
        """Stop waiting for an answer to fast request ``req`` (rank to rank: only an error would come,
        and none will now be read; one that still arrives is dropped)."""
        with self._fast_cond:
            self._fast_stash.pop(req, None)

    def request(self, msg: s.Request, timeout_s: float = 60.0, fds: list[int] | None = None) -> s.Reply:
        """Send ``msg`` (with ``fds``, see :meth:`send`) and wait for its reply."""
        return self.wait(self.send(msg, fds=fds), timeout_s)

    def scratch(self, nbytes: int) -> Arena:
        """A shared-memory buffer of its own, for one point-to-point message in flight."""
        return Arena.create(arena_name(self.session, f"{self.tag}-x{next(self._scratch)}"), max(nbytes, 1))

    def arena(self, nbytes: int) -> Arena:
        """This rank's shared-memory arena, grown (by doubling) to hold ``nbytes``."""
        if self._arena is None or self._arena.size < nbytes:
            size = max(nbytes, 2 * (self._arena.size if self._arena else 1 << 20))
            if self._arena is not None:
                self._arena.close()
                self._arena.unlink()  # the daemon keeps its own mapping until it lets go
            self._generation += 1
            self._arena = Arena.create(arena_name(self.session, f"{self.tag}-g{self._generation}"), size)
        return self._arena

    def close(self) -> None:
        self.flush()
        if self._arena is not None:
            self._arena.unlink()
        if self._fast is not None:
            self._fast.close()
            self._fast_tx.close()
        self._sock.close(0)


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def arena_tensor(arena: Arena, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor sharing the arena's memory at ``offset``."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(arena.buf, dtype=dtype, count=numel, offset=offset)
