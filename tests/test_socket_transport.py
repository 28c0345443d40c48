"""The NET/Socket data path: collective bytes as ZeroMQ frames instead of shared memory.

Two halves. Against a real ``python -m emulator`` (ranks are DEALER sockets of
this process, no torch): every op with its data in frames, a communicator
whose ranks use different transports, multi-frame inputs, and malformed
frames, each answered with an error while the daemon carries on. Then through
the real ``mirage`` CLI: the collective and point-to-point fixtures under
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` and on two emulated nodes, where
events.jsonl must show every collective travelling over the socket.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import zmq
from daemon_client import TIMEOUT_S, DaemonProcess, Events
from test_run import FIXTURES, SOCKET_ENV, events, mirage_run

from wire import schema as s
from wire.arena import Arena, arena_name
from wire.kernels import Segmented

C = s.CollOp
SOCKET = s.Transport.SOCKET
FRAME = s.MAX_DATA_FRAME_BYTES


@pytest.fixture(autouse=True)
def _daemon_survives(request):
    yield
    if "daemon" in request.fixturenames:
        d = request.getfixturevalue("daemon")
        assert d.alive(), d.stderr()
        assert "Traceback" not in d.stderr(), d.stderr()


class SocketRank:
    """One rank whose collectives carry their data as frames (and read the output frame of each reply)."""

    def __init__(self, d: DaemonProcess, comm: str, rank: int, size: int, device: int | None = None):
        self.comm, self.rank, self.token = comm, rank, d.token
        self.device = rank if device is None else device
        self.sock = d.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(d.rpc_endpoint)
        self.req = 0
        self.seq = 0
        self.call(s.CommInit(comm=comm, rank=rank, size=size, global_rank=rank, host="h0", transport="socket"))

    def send(self, msg: s.Request, frames=()) -> int:
        self.req += 1
        head = s.encode(type(msg)(**{**msg.__dict__, "token": self.token, "req": self.req}))
        self.sock.send_multipart([head, *frames])
        return self.req

    def recv(self, timeout_s: float = TIMEOUT_S) -> tuple[s.Reply, list[bytes]]:
        assert self.sock.poll(timeout_s * 1000), "no reply from the daemon"
        head, *data = self.sock.recv_multipart()
        return s.decode(head), data

    def call(self, msg: s.Request, frames=()) -> s.Reply:
        req = self.send(msg, frames)
        reply, _ = self.recv()
        assert reply.req == req
        return reply

    def post(self, op: s.CollOp, data: np.ndarray | None, numel: int, dtype: str = "float32", **kw) -> int:
        """Post this rank's next collective with ``data``'s bytes as frames of at most FRAME bytes."""
        self.seq += 1
        raw = b"" if data is None else np.ascontiguousarray(data).tobytes()
        frames = [raw[i : i + FRAME] for i in range(0, len(raw), FRAME)]
        kw.setdefault("device", self.device)
        msg = s.Collective(comm=self.comm, seq=kw.pop("seq", self.seq), rank=self.rank, op=op, dtype=dtype,
                           numel=numel, transport=SOCKET, **kw)
        return self.send(msg, frames)

    def close(self) -> None:
        self.sock.close(0)


def socket_group(d: DaemonProcess, size: int) -> list[SocketRank]:
    comm = uuid.uuid4().hex
    return [SocketRank(d, comm, r, size) for r in range(size)]


def run(ranks: list[SocketRank], op: s.CollOp, inputs: list[np.ndarray | None], numel: int, out_numel: int,
        dtype: str = "float32", **kw) -> list[np.ndarray | None]:
    """Post on every rank, then read each Done and the output frame after it (None when there is none)."""
    for r, x in zip(ranks, inputs):
        r.post(op, x, numel, dtype, out_numel=out_numel, **kw)
    outs = []
    for r in ranks:
        reply, data = r.recv()
        assert isinstance(reply, s.Done), reply
        assert len(data) <= 1
        outs.append(np.frombuffer(data[0], np.dtype(dtype)) if data else None)
    return outs


# ---------------------------------------------------------------- in process: frames read as one array


def test_segmented_slices_like_one_array():
    flat = np.arange(100, dtype=np.int32)
    seg = Segmented([flat[:40].view(np.uint8), flat[40:80].view(np.uint8), flat[80:].view(np.uint8)]).view(np.int32)
    assert len(seg) == 100
    for a, b in ((0, 100), (0, 40), (40, 80), (39, 41), (10, 95), (99, 100), (50, 50), (100, 100), (0, 0)):
        np.testing.assert_array_equal(seg[a:b], flat[a:b])
    assert np.shares_memory(seg[45:60], flat)  # inside one frame: a view, not a copy


# ---------------------------------------------------------------- every op over frames


def test_allreduce_over_frames(daemon):
    ranks = socket_group(daemon, 3)
    xs = [np.arange(1000, dtype=np.float32) * (r + 1) for r in range(3)]
    for out in run(ranks, C.ALLREDUCE, xs, 1000, 1000):
        np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float32) * 6)


def test_every_collective_over_frames(daemon):
    size, n = 3, 4
    ranks = socket_group(daemon, size)
    x = [np.arange(n, dtype=np.int64) + 10 * r for r in range(size)]
    gathered = np.concatenate(x)
    for out in run(ranks, C.ALLGATHER, x, n, n * size, "int64"):
        np.testing.assert_array_equal(out, gathered)
    # broadcast from 1: only the root sends, the others get it; the root gets nothing back
    outs = run(ranks, C.BROADCAST, [None, x[1], None], n, n, "int64", root=1)
    assert outs[1] is None and all((o == x[1]).all() for k, o in enumerate(outs) if k != 1)
    outs = run(ranks, C.REDUCE, x, n, n, "int64", root=2)
    assert outs[0] is None and outs[1] is None
    np.testing.assert_array_equal(outs[2], sum(x))
    outs = run(ranks, C.GATHER, x, n, n * size, "int64", root=0)
    np.testing.assert_array_equal(outs[0], gathered)
    assert outs[1] is None
    big = [np.arange(n * size, dtype=np.int64) * (r + 1) for r in range(size)]
    outs = run(ranks, C.REDUCE_SCATTER, big, n * size, n, "int64")
    total = sum(big)
    for r, out in enumerate(outs):
        np.testing.assert_array_equal(out, total[r * n : (r + 1) * n])
    outs = run(ranks, C.SCATTER, [gathered, None, None], n, n, "int64", root=0)
    for r, out in enumerate(outs):
        np.testing.assert_array_equal(out, x[r])
    # all-to-all with uneven splits: rank r sends r + 1 elements to each peer
    splits = [[r + 1] * size for r in range(size)]
    srcs = [np.full(3 * (r + 1), r, np.int64) for r in range(size)]
    outs = [None] * size
    for r, rank in enumerate(ranks):
        rank.post(C.ALLTOALL, srcs[r], 3 * (r + 1), "int64", out_numel=sum(k + 1 for k in range(size)),
                  splits=splits[r])
    for r, rank in enumerate(ranks):
        reply, data = rank.recv()
        assert isinstance(reply, s.Done), reply
        outs[r] = np.frombuffer(data[0], np.int64)
    for out in outs:
        assert out.tolist() == [0, 1, 1, 2, 2, 2]
    outs = run(ranks, C.BARRIER, [None] * size, 0, 0)
    assert outs == [None] * size


def test_send_and_receive_over_frames(daemon):
    a, b = socket_group(daemon, 2)
    msg = np.arange(300, dtype=np.float16)
    a.send(s.Collective(comm=a.comm, seq=1, rank=0, op=C.SEND, dtype="float16", numel=300, out_numel=300, peer=1,
                        transport=SOCKET), [msg.tobytes()])
    b.send(s.Collective(comm=b.comm, seq=1, rank=1, op=C.RECV, dtype="float16", numel=300, out_numel=300, peer=0,
                        transport=SOCKET, device=1))
    sent, nothing = a.recv()
    got, data = b.recv()
    assert isinstance(sent, s.Done) and nothing == []
    assert isinstance(got, s.Done)
    np.testing.assert_array_equal(np.frombuffer(data[0], np.float16), msg)


def test_input_over_several_frames(daemon):
    """A 20 MiB input arrives in two frames (16 MiB + 4 MiB); chunks that straddle them still add up."""
    ranks = socket_group(daemon, 2)
    n = 5 << 20  # float32: 20 MiB
    xs = [np.arange(n, dtype=np.float32), np.ones(n, np.float32)]
    outs = run(ranks, C.ALLREDUCE, xs, n, n)
    want = np.arange(n, dtype=np.float32) + 1
    for out in outs:
        np.testing.assert_array_equal(out, want)
    # all-gather reads every input at offsets that do not line up with the frames
    m = (4 << 20) + 3
    ys = [np.full(m, 1, np.int32), np.full(m, 2, np.int32)]
    outs = run(ranks, C.ALLGATHER, ys, m, 2 * m, "int32")
    assert outs[0][m - 1] == 1 and outs[0][m] == 2 and (outs[1] == np.repeat([1, 2], m)).all()


def test_shm_and_socket_ranks_in_one_communicator(daemon):
    """The transport is each rank's: one rank's bytes in its arena, the other's in frames."""
    comm = uuid.uuid4().hex
    sock_rank = SocketRank(daemon, comm, 1, 2)
    shm = daemon.client()
    assert isinstance(shm.call(s.CommInit(comm=comm, rank=0, size=2, global_rank=0, host="h0")), s.Ok)
    arena = daemon.track(Arena.create(arena_name(daemon.session, f"mix-{comm[:6]}-r0"), 4096))
    arena.bytes_view(0, 64).view(np.float32)[:] = np.arange(16, dtype=np.float32)
    shm.send(s.Collective(comm=comm, seq=1, rank=0, numel=16, out_numel=16, device=0, arena=arena.name))
    sock_rank.post(C.ALLREDUCE, np.full(16, 100, np.float32), 16, out_numel=16)
    assert isinstance(shm.recv(), s.Done)
    reply, data = sock_rank.recv()
    want = np.arange(16, dtype=np.float32) + 100
    np.testing.assert_array_equal(arena.bytes_view(0, 64).view(np.float32), want)
    np.testing.assert_array_equal(np.frombuffer(data[0], np.float32), want)


def test_enqueued_events_name_the_transport(daemon):
    ev = Events(daemon)
    try:
        ranks = socket_group(daemon, 2)
        run(ranks, C.ALLREDUCE, [np.ones(4, np.float32)] * 2, 4, 4)
        seen = ev.until(lambda e: isinstance(e, s.CollectiveCompleted) and e.comm == ranks[0].comm)
    finally:
        ev.close()
    enqueued = [e for e in seen if isinstance(e, s.CollectiveEnqueued) and e.comm == ranks[0].comm]
    assert [e.transport for e in enqueued] == [SOCKET, SOCKET]


# ---------------------------------------------------------------- malformed frames


def _refused(rank: SocketRank, frames: list[bytes], msg: s.Request) -> s.Error:
    req = rank.send(msg, frames)
    reply, data = rank.recv()
    assert isinstance(reply, s.Error) and reply.req == req and data == [], reply
    return reply


def test_frames_that_do_not_match_the_declared_shape_fail_the_communicator(daemon):
    for frames, numel in (([b"\0" * 12], 4), ([b"\0" * 20], 4), ([], 4), ([b"\0" * 16], 0)):
        a, b = socket_group(daemon, 2)
        b.post(C.ALLREDUCE, np.ones(4, np.float32), 4, out_numel=4)  # the honest peer, waiting
        msg = s.Collective(comm=a.comm, seq=1, rank=0, numel=numel, out_numel=numel, device=0, transport=SOCKET)
        err = _refused(a, frames, msg)
        assert err.code == "ncclInvalidArgument" and "bytes of data frames" in err.message, err
        # the peer hears it too (its communicator failed) instead of waiting forever
        reply, _ = b.recv()
        assert isinstance(reply, s.Error) and reply.code == "ncclInvalidArgument"


def test_badly_cut_frames_and_stray_frames_are_refused(daemon):
    (a,) = socket_group(daemon, 1)
    coll = s.Collective(comm=a.comm, seq=1, rank=0, numel=4, out_numel=4, transport=SOCKET)
    for frames in ([b"\0" * 8, b"\0" * 8], [b"", b"\0" * 16], [b"\0" * 16, b""]):
        err = _refused(a, frames, coll)
        assert err.code == "protocol" and "each must be" in err.message, err
    # data frames after anything but a socket-transport collective
    for msg in (s.Ping(), s.Collective(comm=a.comm, seq=1, rank=0, numel=4, out_numel=4), s.Hello(rank=0, pid=1)):
        err = _refused(a, [b"\0" * 16], msg)
        assert err.code == "protocol" and "one frame" in err.message, err
    # a wrong token is refused before the frames are looked at
    a.token = "nope"
    err = _refused(a, [b"\0" * 16], coll)
    assert err.code == "protocol" and "token" in err.message
    a.token = daemon.token
    # and after all that, the rank's collective #1 still runs
    outs = run([a], C.ALLREDUCE, [np.full(4, 3, np.float32)], 4, 4)
    assert outs[0].tolist() == [3.0] * 4


def test_a_frame_over_the_limit_drops_the_connection_not_the_daemon(daemon):
    (a,) = socket_group(daemon, 1)
    a.sock.send_multipart([s.encode(s.Ping(token=daemon.token, req=99)), b"\0" * (FRAME + 4)])
    assert not a.sock.poll(1000)
    assert daemon.alive()


# ---------------------------------------------------------------- end to end, real ranks


def _socket_only(tmp_path) -> list[dict]:
    """The run's events, after checking every collective and every communicator used the socket."""
    ev = events(tmp_path)
    joined = [e for e in ev if e["type"] == "comm_joined"]
    enqueued = [e for e in ev if e["type"] == "coll_enqueued"]
    assert joined and enqueued
    assert {e["transport"] for e in joined} == {"socket"}, {e["transport"] for e in joined}
    assert {e["transport"] for e in enqueued} == {"socket"}
    return ev


@pytest.mark.parametrize("fixture, ok", [("collectives_check.py", "[0] collectives_ok"),
                                         ("p2p_check.py", "[2] [rank 2] p2p_ok")])
@pytest.mark.usefixtures("no_orphans")
def test_fixtures_with_p2p_and_shm_disabled(tmp_path, fixture, ok):
    r = mirage_run(tmp_path, "--gpus-per-node", "3", *SOCKET_ENV, "--env", "NCCL_DEBUG=INFO", "--", "torchrun",
                   "--standalone", "--nproc_per_node=3", str(FIXTURES / fixture))
    assert r.returncode == 0, r.stdout + r.stderr
    assert ok in r.stdout
    assert "[0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/Socket/0" in r.stdout
    assert "NCCL INFO NET/Socket : Using [0]lo" in r.stdout
    _socket_only(tmp_path)


@pytest.mark.usefixtures("no_orphans")
def test_collectives_on_two_nodes_go_over_the_socket(tmp_path):
    """No NCCL_*_DISABLE: ranks on different emulated nodes use the socket anyway, as NCCL uses NET."""
    launch = ("exec torchrun --nnodes=2 --nproc_per_node=2 --node_rank=$MIRAGE_NODE_RANK "
              f"--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT {FIXTURES / 'collectives_check.py'}")
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", "--", "bash", "-c", launch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] collectives_ok" in r.stdout
    _socket_only(tmp_path)


@pytest.mark.usefixtures("no_orphans")
def test_a_group_within_one_node_keeps_shared_memory(tmp_path):
    """On two nodes the world group is NET/Socket and each node's own group stays on shared memory."""
    launch = ("exec torchrun --nnodes=2 --nproc_per_node=2 --node_rank=$MIRAGE_NODE_RANK "
              f"--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT {FIXTURES / 'transport_check.py'}")
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", "--env", "NCCL_DEBUG=INFO", "--",
                   "bash", "-c", launch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f"[{k}] [rank {k}] transport_ok" in r.stdout for k in range(4))
    ev = events(tmp_path)
    by_comm: dict[str, set] = {}
    for e in ev:
        if e["type"] == "comm_joined":
            by_comm.setdefault((e["comm"], e["size"]), set()).add(e["transport"])
    assert sorted((size, tuple(t)) for (_, size), t in by_comm.items()) == [
        (2, ("shm",)), (2, ("shm",)), (4, ("socket",))], by_comm
    world = next(c for (c, size) in by_comm if size == 4)
    for e in ev:
        if e["type"] == "coll_enqueued":
            assert e["transport"] == ("socket" if e["comm"] == world else "shm"), e
    # the world group's ring crosses the node boundary between ranks 1 and 2
    assert "[1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] via NET/Socket/0" in r.stdout


@pytest.mark.usefixtures("no_orphans")
def test_ddp_trains_over_the_socket(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", *SOCKET_ENV, "--",
                   "python", str(FIXTURES / "ddp_mlp.py"), steps=20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] [rank 0] all ranks converged with identical replicas" in r.stdout
    ev = _socket_only(tmp_path)
    assert sum(e["type"] == "coll_completed" for e in ev) > 20
