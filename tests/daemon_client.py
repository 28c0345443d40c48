"""Test helpers that drive a real ``python -m emulator`` daemon over ZeroMQ.

No torch here: ranks are played by DEALER sockets of the test process itself,
each with its own shared-memory arena, so one test can be every rank of a
communicator (post everything first, then collect the replies).
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import zmq

from wire import schema as s
from wire.arena import Arena, arena_name, session_segments
from wire.endpoints import FAST_SOCKET, endpoints
from wire.kernels import DTYPES

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Longest a test waits for any one reply or event before failing (never hangs).
TIMEOUT_S = 10.0
_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def stamped(msg: s.Request, token: str, req: int) -> bytes:
    """``msg`` encoded with the session token and request id a rank's client would fill in."""
    return s.encode(type(msg)(**{**msg.__dict__, "token": token, "req": req}))


class Client:
    """One DEALER socket: sends requests (token and id filled in), receives replies."""

    def __init__(self, ctx: zmq.Context, endpoint: str, token: str):
        self.token = token
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)

    def send(self, msg: s.Request, token: str | None = None) -> int:
        """Send ``msg`` with a fresh request id; return that id."""
        req = next(self._ids)
        self.sock.send(stamped(msg, self.token if token is None else token, req))
        return req

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = TIMEOUT_S) -> s.Reply:
        if not self.sock.poll(timeout_s * 1000):
            raise TimeoutError(f"no reply from the daemon within {timeout_s} s")
        reply = s.decode(self.sock.recv())
        assert isinstance(reply, s.Reply), reply
        return reply

    def has_reply(self, timeout_s: float = 0.0) -> bool:
        return bool(self.sock.poll(timeout_s * 1000))

    def call(self, msg: s.Request, token: str | None = None, timeout_s: float = TIMEOUT_S) -> s.Reply:
        req = self.send(msg, token)
        reply = self.recv(timeout_s)
        assert reply.req == req, (reply, req)
        return reply

    def close(self) -> None:
        self.sock.close(0)


class FastClient:
    """A rank's connection to the daemon's fast socket (unix SOCK_SEQPACKET), as ``shim/rank/client.py`` uses it.

    The interface of ``daemon_client.Client``, so a group's rank can use either.
    """

    def __init__(self, daemon):
        self.token = daemon.token
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(os.path.join(daemon.run_dir, FAST_SOCKET))
        self._ids = itertools.count(1)

    def send(self, msg: s.Request, token: str | None = None) -> int:
        req = next(self._ids)
        self.sock.send(stamped(msg, self.token if token is None else token, req))
        return req

    def send_raw(self, data: bytes) -> None:
        self.sock.send(data)

    def send_fds(self, msg: s.Request, fds: list[int]) -> int:
        """Send ``msg`` with file descriptors (SCM_RIGHTS), as ``RegisterBuffer`` travels."""
        req = next(self._ids)
        socket.send_fds(self.sock, [s.encode(msg, token=self.token, req=req)], fds)
        return req

    def recv(self, timeout_s: float = TIMEOUT_S) -> s.Reply:
        self.sock.settimeout(timeout_s)
        reply = s.decode(self.sock.recv(s.MAX_MESSAGE_BYTES))
        assert isinstance(reply, s.Reply), reply
        return reply

    def call(self, msg: s.Request, token: str | None = None) -> s.Reply:
        req = self.send(msg, token)
        reply = self.recv()
        assert reply.req == req, (reply, req)
        return reply

    def close(self) -> None:
        self.sock.close()


class Events:
    """A SUB socket on the daemon's event stream, synchronised by a Ping."""

    def __init__(self, daemon: DaemonProcess):
        self.sock = daemon.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(daemon.events_endpoint)
        try:
            self._sync(daemon)
        except BaseException:
            self.sock.close(0)
            raise

    def _sync(self, daemon: DaemonProcess) -> None:
        # PUB drops what it sends before the subscription arrives: ping until
        # our own daemon_ready comes through, then everything after is seen
        pinger = daemon.client()
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                assert time.monotonic() < deadline, "never saw daemon_ready on the event socket"
                assert isinstance(pinger.call(s.Ping()), s.Ok)
                if self.sock.poll(100) and any(isinstance(e, s.DaemonReady) for e in self.drain()):
                    break
        finally:
            pinger.close()

    def drain(self, timeout_s: float = 0.0) -> list[s.Event]:
        """Every event that arrives within ``timeout_s`` (those already queued at least)."""
        out = []
        while self.sock.poll(timeout_s * 1000):
            out.extend(s.decode_events(self.sock.recv()))
            timeout_s = 0.0
        return out

    def until(self, pred, timeout_s: float = TIMEOUT_S) -> list[s.Event]:
        """Collect events up to and including the first for which ``pred`` holds."""
        out = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(left * 1000):
                raise TimeoutError(f"event not seen within {timeout_s} s; saw {[e.TYPE for e in out]}")
            for ev in s.decode_events(self.sock.recv()):
                out.append(ev)
                if pred(ev):
                    return out

    def close(self) -> None:
        self.sock.close(0)


class Rank:
    """One emulated rank: a client, its communicator membership and its arena."""

    def __init__(self, group: Group, rank: int, device: int, host: str):
        self.group = group
        self.rank = rank
        self.device = device
        self.host = host
        self.client = group.daemon.client()
        self.arena: Arena | None = None
        self.seq = 0
        self._generation = 0

    def ensure_arena(self, nbytes: int) -> Arena:
        if self.arena is None or self.arena.size < nbytes:
            if self.arena is not None:
                self.arena.close()
                self.arena.unlink()
            self._generation += 1
            name = arena_name(self.group.daemon.session, f"t{self.group.tag}-r{self.rank}-g{self._generation}")
            self.arena = self.group.daemon.track(Arena.create(name, max(nbytes, 4096)))
        return self.arena

    def write(self, off: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.arena.bytes_view(off, raw.size)[:] = raw

    def read(self, off: int, numel: int, np_dtype) -> np.ndarray:
        n = numel * np.dtype(np_dtype).itemsize
        return self.arena.bytes_view(off, n).view(np_dtype).copy()

    def post(self, op: s.CollOp, numel: int, dtype: str = "float32", **kw) -> int:
        """Post this rank's next collective (``seq`` auto-increments unless given)."""
        if "seq" not in kw:
            self.seq += 1
            kw["seq"] = self.seq
        kw.setdefault("arena", self.arena.name if self.arena else "")
        kw.setdefault("device", self.device)
        return self.client.send(
            s.Collective(comm=self.group.comm, rank=self.rank, op=op, dtype=dtype, numel=numel, **kw)
        )

    def close(self) -> None:
        self.client.close()
        if self.arena is not None:
            self.arena.close()
            self.arena.unlink()


class Group:
    """``size`` ranks of one fresh communicator, all joined."""

    _tags = itertools.count()

    def __init__(self, daemon: DaemonProcess, size: int, devices=None, hosts=None, join: bool = True):
        self.daemon = daemon
        self.size = size
        self.comm = uuid.uuid4().hex
        self.tag = next(Group._tags)
        devices = list(range(size)) if devices is None else devices
        hosts = ["host0"] * size if hosts is None else hosts
        self.ranks = [Rank(self, r, devices[r], hosts[r]) for r in range(size)]
        daemon.groups.append(self)
        if join:
            self.join()

    def join(self) -> None:
        for r in self.ranks:
            r.client.send(
                s.CommInit(
                    comm=self.comm, rank=r.rank, size=self.size, global_rank=r.rank, node=0, host=r.host,
                    transport="shm",
                )
            )
        for r in self.ranks:
            reply = r.client.recv()
            assert isinstance(reply, s.Ok), reply

    def replies(self, timeout_s: float = TIMEOUT_S) -> list[s.Reply]:
        return [r.client.recv(timeout_s) for r in self.ranks]

    def run(
        self,
        op: s.CollOp,
        inputs: list[np.ndarray] | None,
        dtype: str = "float32",
        reduce_op: s.ReduceOp = s.ReduceOp.SUM,
        root: int = 0,
        in_place: bool = True,
    ) -> list[np.ndarray]:
        """Run one collective on every rank; return each rank's output array.

        ``inputs`` hold numpy storage arrays (bfloat16 as uint16 bits), one per rank.
        """
        np_dtype = DTYPES[dtype]
        esize = np_dtype.itemsize
        numel = 0 if inputs is None else inputs[0].size
        out_numel = {
            s.CollOp.ALLREDUCE: numel,
            s.CollOp.BROADCAST: numel,
            s.CollOp.ALLGATHER: numel * self.size,
            s.CollOp.REDUCE_SCATTER: numel // self.size,
            s.CollOp.BARRIER: 0,
        }[op]
        same = in_place and op in (s.CollOp.ALLREDUCE, s.CollOp.BROADCAST)
        out_off = 0 if same else _aligned(numel * esize)
        reqs = []
        for r, rank in enumerate(self.ranks):
            rank.ensure_arena(max(numel * esize, out_off + out_numel * esize))
            if inputs is not None:
                rank.write(0, inputs[r].astype(np_dtype, copy=False))
            reqs.append(
                rank.post(
                    op, numel, dtype, reduce_op=reduce_op, out_numel=out_numel, root=root, in_off=0, out_off=out_off
                )
            )
        for rank, req in zip(self.ranks, reqs):
            reply = rank.client.recv()
            assert isinstance(reply, s.Done), reply
            assert (reply.req, reply.comm, reply.seq) == (req, self.comm, rank.seq)
        return [rank.read(out_off, out_numel, np_dtype) for rank in self.ranks]

    def close(self) -> None:
        for r in self.ranks:
            r.close()


class DaemonProcess:
    """A daemon subprocess in a private 0700 run directory."""

    def __init__(self, gpus_per_node: int = 4, hang_timeout_s: float = 30.0, listen: str = ""):
        """``listen``: an address the daemon also takes ranks on over TCP (CURVE; ``server_key`` is its public key)."""
        self.session = secrets.token_hex(4)
        self.token = secrets.token_hex(16)
        # short path: ipc:// endpoints must fit in a unix socket address
        self.run_dir = tempfile.mkdtemp(prefix="mirage-t-")
        os.chmod(self.run_dir, 0o700)
        self.token_file = os.path.join(self.run_dir, "token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        self.stderr_path = os.path.join(self.run_dir, "daemon.stderr")
        self._stderr = open(self.stderr_path, "wb")
        self.rpc_endpoint, self.events_endpoint = endpoints(self.run_dir)
        self.ctx = zmq.Context()
        self.groups: list[Group] = []
        self._arenas: list[Arena] = []
        self._clients: list[Client] = []
        tcp = []
        if listen:
            public, secret = zmq.curve_keypair()
            self.server_key = public.decode()
            key_file = os.path.join(self.run_dir, "curve.secret")
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secret)
            tcp = ["--listen", listen, "--curve-secret-file", key_file]
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "emulator", "--run-dir", self.run_dir, "--session", self.session,
                "--token-file", self.token_file, "--profile", "mi350x", "--nodes", "1",
                "--gpus-per-node", str(gpus_per_node), "--hang-timeout", str(hang_timeout_s), *tcp,
            ],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=self._stderr,
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        c = self.client()
        try:
            c.send(s.Ping())  # queued by the DEALER until the daemon binds
            deadline = time.monotonic() + timeout_s
            while not c.has_reply(0.05):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.stderr()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"daemon not ready within {timeout_s} s: {self.stderr()}")
            assert isinstance(c.recv(), s.Ok)
        finally:
            c.close()
            self._clients.remove(c)

    def client(self) -> Client:
        c = Client(self.ctx, self.rpc_endpoint, self.token)
        self._clients.append(c)
        return c

    def group(self, size: int, **kw) -> Group:
        return Group(self, size, **kw)

    def track(self, arena: Arena) -> Arena:
        self._arenas.append(arena)
        return arena

    def alive(self) -> bool:
        """The process runs and answers a Ping."""
        if self.proc.poll() is not None:
            return False
        c = self.client()
        try:
            return isinstance(c.call(s.Ping(), timeout_s=5.0), s.Ok)
        finally:
            c.close()
            self._clients.remove(c)

    def stderr(self) -> str:
        try:
            return Path(self.stderr_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the daemon and remove everything it and the test left behind."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
        finally:
            for a in [a for g in self.groups for r in g.ranks if (a := r.arena)] + self._arenas:
                a.close()
                a.unlink()
            for path in session_segments(self.session):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            # destroy, not term: a socket a failed test left open must not hang teardown
            self.ctx.destroy(linger=0)
            self._stderr.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)


# ------------------------------------------------------------ bfloat16 reference


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (a reference independent of the kernels)."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32)
    lo16 = (u >> 16).astype(np.uint16)  # truncation: the candidate toward zero
    with np.errstate(invalid="ignore", over="ignore"):
        lo = (u & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
        hi32 = ((u & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
        # one step past bf16's largest finite value is 2^128 (which rounds to inf)
        hi = np.where(np.isinf(hi32), np.sign(x.astype(np.float64)) * 2.0**128, hi32.astype(np.float64))
        d_lo = np.abs(x.astype(np.float64) - lo)
        d_hi = np.abs(hi - x.astype(np.float64))
    take_hi = np.isfinite(x) & ((d_hi < d_lo) | ((d_hi == d_lo) & (lo16 & 1 == 1)))
    out = np.where(take_hi, lo16 + np.uint16(1), lo16).astype(np.uint16)
    return np.where(np.isnan(x), lo16 | np.uint16(0x0040), out).astype(np.uint16)  # NaN stays (quiet) NaN


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def fast_group(d: DaemonProcess, size: int) -> Group:
    """``size`` ranks of a fresh communicator, each on the fast socket, joined."""
    g = d.group(size, join=False)
    for r in g.ranks:
        r.client.close()
        r.client = FastClient(d)
    g.join()
    return g
