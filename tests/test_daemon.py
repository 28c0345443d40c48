"""The real daemon process: collectives over ZeroMQ + shared memory, errors, abuse.

Each test module starts one ``python -m emulator`` (and a few tests start their
own); ranks are DEALER sockets of this process, each with its own /dev/shm
arena. No torch.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import time

import numpy as np
import pytest
from daemon_client import TIMEOUT_S, DaemonProcess, Events, FastClient, bf16_bits, bf16_to_f32, fast_group

from wire import schema as s
from wire.arena import Arena, arena_name

C = s.CollOp
R = s.ReduceOp


@pytest.fixture
def fresh_daemon():
    """A daemon of the test's own, for tests that abuse it."""
    d = DaemonProcess()
    try:
        yield d
        _check_survived(d)
    finally:
        d.stop()


def _check_survived(d: DaemonProcess) -> None:
    assert d.alive(), f"daemon died:\n{d.stderr()}"
    assert "Traceback" not in d.stderr(), d.stderr()


@pytest.fixture(autouse=True)
def _daemon_survives(request):
    yield
    if "daemon" in request.fixturenames:
        _check_survived(request.getfixturevalue("daemon"))


def rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- collectives


def test_daemon_runs_in_private_dir_without_token_in_argv(daemon):
    assert os.stat(daemon.run_dir).st_mode & 0o777 == 0o700
    assert os.path.exists(os.path.join(daemon.run_dir, "rpc.sock"))
    assert os.path.exists(os.path.join(daemon.run_dir, "events.sock"))
    assert daemon.token not in " ".join(daemon.proc.args)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_allreduce_float32_sum(daemon, size):
    g = daemon.group(size)
    xs = [rng(size * 10 + r).integers(-1000, 1000, 1031).astype(np.float32) for r in range(size)]
    outs = g.run(C.ALLREDUCE, xs)
    want = np.sum(np.stack(xs), axis=0, dtype=np.float64).astype(np.float32)
    for out in outs:
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_allreduce_int64_sum(daemon, size):
    g = daemon.group(size)
    xs = [rng(size + r).integers(-(2**40), 2**40, 777, dtype=np.int64) for r in range(size)]
    for out in g.run(C.ALLREDUCE, xs, dtype="int64"):
        np.testing.assert_array_equal(out, np.sum(np.stack(xs), axis=0))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_allreduce_bfloat16_sum(daemon, size):
    g = daemon.group(size)
    vals = [rng(100 + r).standard_normal(2053).astype(np.float32) * 10 for r in range(size)]
    bits = [bf16_bits(v) for v in vals]
    outs = g.run(C.ALLREDUCE, bits, dtype="bfloat16")
    # RCCL reduces bf16 in float32 and rounds once, to nearest even
    exact = np.sum(np.stack([bf16_to_f32(b).astype(np.float64) for b in bits]), axis=0)
    for out in outs:
        assert out.dtype == np.uint16
        np.testing.assert_allclose(bf16_to_f32(out), exact, rtol=2**-8, atol=1e-30)
        if size == 2:  # two bf16 values sum exactly in float32: one rounding
            np.testing.assert_array_equal(out, bf16_bits(exact.astype(np.float32)))


@pytest.mark.parametrize(
    "reduce_op,ref",
    [(R.MAX, np.maximum.reduce), (R.MIN, np.minimum.reduce), (R.PRODUCT, np.multiply.reduce)],
)
def test_allreduce_other_ops(daemon, reduce_op, ref):
    g = daemon.group(3)
    xs = [rng(7 + r).integers(-5, 6, 300).astype(np.int32) for r in range(3)]
    for out in g.run(C.ALLREDUCE, xs, dtype="int32", reduce_op=reduce_op):
        np.testing.assert_array_equal(out, ref(np.stack(xs)))


def test_allreduce_out_of_place(daemon):
    g = daemon.group(2)
    xs = [np.arange(100, dtype=np.float32) * (r + 1) for r in range(2)]
    outs = g.run(C.ALLREDUCE, xs, in_place=False)
    for rank, out in zip(g.ranks, outs):
        np.testing.assert_array_equal(out, np.arange(100, dtype=np.float32) * 3)
        # the input stays as written
        np.testing.assert_array_equal(rank.read(0, 100, np.float32), xs[rank.rank])


@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_from_root_1(daemon, size):
    g = daemon.group(size)
    xs = [np.full(513, 10.0 * r, np.float32) for r in range(size)]
    xs[1] = rng(3).standard_normal(513).astype(np.float32)
    for out in g.run(C.BROADCAST, xs, root=1):
        np.testing.assert_array_equal(out, xs[1])


@pytest.mark.parametrize("size", [2, 4])
def test_allgather(daemon, size):
    g = daemon.group(size)
    xs = [rng(r).standard_normal(37).astype(np.float32) for r in range(size)]
    for out in g.run(C.ALLGATHER, xs):
        np.testing.assert_array_equal(out, np.concatenate(xs))


@pytest.mark.parametrize("size", [2, 3])
def test_reduce_scatter(daemon, size):
    g = daemon.group(size)
    n = 41
    xs = [rng(50 + r).integers(-100, 100, n * size).astype(np.float32) for r in range(size)]
    total = np.sum(np.stack(xs), axis=0)
    outs = g.run(C.REDUCE_SCATTER, xs)
    for r, out in enumerate(outs):
        assert out.size == n
        np.testing.assert_array_equal(out, total[r * n : (r + 1) * n])


def test_barrier(daemon):
    g = daemon.group(3)
    for _ in range(3):
        assert all(out.size == 0 for out in g.run(C.BARRIER, None))
    # a barrier only completes when every rank arrived
    for rank in g.ranks[:2]:
        rank.post(C.BARRIER, 0)
    assert not any(r.client.has_reply(0.2) for r in g.ranks[:2])
    g.ranks[2].post(C.BARRIER, 0)
    assert all(isinstance(rep, s.Done) for rep in g.replies())


def test_large_allreduce_publishes_progress(daemon):
    events = Events(daemon)
    try:
        g = daemon.group(2)
        numel = (24 << 20) // 4  # 24 MiB of float32 per rank: more than one 16 MiB wave
        xs = [np.arange(numel, dtype=np.float32) % 1024, np.full(numel, 3.0, np.float32)]
        outs = g.run(C.ALLREDUCE, xs)
        want = xs[0] + 3.0
        for out in outs:
            np.testing.assert_array_equal(out, want)
        seen = events.until(lambda e: isinstance(e, s.CollectiveCompleted) and e.comm == g.comm)
    finally:
        events.close()
    mine = [e for e in seen if getattr(e, "comm", None) == g.comm]
    kinds = [e.TYPE for e in mine]
    assert kinds.count("comm_joined") == 2
    assert kinds.count("coll_enqueued") == 2
    assert kinds.index("coll_started") < kinds.index("coll_progress") < kinds.index("coll_completed")
    progress = [e for e in mine if isinstance(e, s.CollectiveProgress)]
    assert progress
    done = [e.done_bytes for e in progress]
    assert done == sorted(done) and 0 < done[0] and done[-1] < 24 << 20
    assert all(e.total_bytes == 24 << 20 and e.seq == 1 for e in progress)
    completed = mine[-1]
    assert completed.total_bytes == 24 << 20 and completed.op is C.ALLREDUCE and completed.seconds >= 0


def test_many_sequential_allreduces_complete_in_order(daemon):
    g = daemon.group(2)
    a, b = g.ranks
    for arena_rank in g.ranks:
        arena_rank.ensure_arena(4096)
    # one at a time, as the shim does
    for i in range(1, 101):
        a.write(0, np.full(4, i, np.int32))
        b.write(0, np.full(4, 2 * i, np.int32))
        ra, rb = a.post(C.ALLREDUCE, 4, "int32", out_numel=4), b.post(C.ALLREDUCE, 4, "int32", out_numel=4)
        da, db = a.client.recv(), b.client.recv()
        assert (da.TYPE, da.req, da.seq, db.TYPE, db.req, db.seq) == ("done", ra, i, "done", rb, i)
        np.testing.assert_array_equal(a.read(0, 4, np.int32), np.full(4, 3 * i, np.int32))
        np.testing.assert_array_equal(b.read(0, 4, np.int32), np.full(4, 3 * i, np.int32))
    # and pipelined: 100 more posted at once, each on its own slot of the arena
    reqs = {a: [], b: []}
    for i in range(100):
        for rank in (a, b):
            rank.write(16 * i, np.full(4, i + rank.rank, np.int32))
            reqs[rank].append(rank.post(C.ALLREDUCE, 4, "int32", out_numel=4, in_off=16 * i, out_off=16 * i))
    for rank in (a, b):
        got = [rank.client.recv() for _ in range(100)]
        assert [(r.TYPE, r.req, r.seq) for r in got] == [("done", q, 101 + i) for i, q in enumerate(reqs[rank])]
        for i in range(100):
            np.testing.assert_array_equal(rank.read(16 * i, 4, np.int32), np.full(4, 2 * i + 1, np.int32))


def test_two_communicators_interleave(daemon):
    # a big job must not hold back a small one posted after it on another communicator
    events = Events(daemon)
    try:
        big, small = daemon.group(2), daemon.group(2)
        numel = (40 << 20) // 4
        for r in big.ranks:
            r.ensure_arena(numel * 4)
            r.write(0, np.ones(numel, np.float32))
        for r in small.ranks:
            r.ensure_arena(64)
            r.write(0, np.ones(4, np.float32))
        # small's second half goes out right after big's: both land in one poll
        small.ranks[0].post(C.ALLREDUCE, 4, out_numel=4)
        for r in big.ranks:
            r.post(C.ALLREDUCE, numel, out_numel=numel)
        small.ranks[1].post(C.ALLREDUCE, 4, out_numel=4)
        assert all(isinstance(x, s.Done) for x in small.replies())
        assert all(isinstance(x, s.Done) for x in big.replies())
        seen = events.until(lambda e: isinstance(e, s.CollectiveCompleted) and e.comm == big.comm)
    finally:
        events.close()
    order = [(e.TYPE, e.comm) for e in seen if isinstance(e, (s.CollectiveStarted, s.CollectiveCompleted))]
    big_done = order.index(("coll_completed", big.comm))
    # small's start comes before big's end, unless this process stalled for ~30 ms (or, under load, the
    # subscription joined after it: PUB/SUB drops what is published before a subscriber connects)
    small_started = ("coll_started", small.comm)
    if small_started in order and order.index(small_started) < big_done:
        assert order.index(("coll_completed", small.comm)) < big_done, order
    assert any(isinstance(e, s.CollectiveProgress) and e.comm == big.comm for e in seen)
    assert big.ranks[0].read(0, numel, np.float32).min() == 2.0
    np.testing.assert_array_equal(small.ranks[1].read(0, 4, np.float32), np.full(4, 2.0, np.float32))


# ---------------------------------------------------------------- NCCL errors


def test_duplicate_gpu_errors_every_rank(daemon):
    g = daemon.group(2, devices=[0, 0], hosts=["nodeA", "nodeA"])
    for r in g.ranks:
        r.ensure_arena(64)
    reqs = [r.post(C.ALLREDUCE, 4, out_numel=4) for r in g.ranks]
    replies = g.replies()
    for rep, req in zip(replies, reqs):
        assert isinstance(rep, s.Error), rep
        assert rep.req == req
        assert rep.code == "ncclInvalidUsage"
        assert rep.message == "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000"
    # the communicator stays failed
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4)
    rep = g.ranks[0].client.recv()
    assert isinstance(rep, s.Error) and "Duplicate GPU" in rep.message
    # the same device on two hosts is fine
    ok = daemon.group(2, devices=[1, 1], hosts=["nodeA", "nodeB"])
    outs = ok.run(C.ALLREDUCE, [np.ones(4, np.float32)] * 2)
    np.testing.assert_array_equal(outs[1], np.full(4, 2.0, np.float32))


def test_duplicate_gpu_bus_id_of_other_devices(daemon):
    g = daemon.group(3, devices=[0, 2, 2])
    for r in g.ranks:
        r.ensure_arena(64)
    for r in g.ranks:
        r.post(C.BARRIER, 0)
    for rep in g.replies():
        assert isinstance(rep, s.Error)
        assert rep.message == "Duplicate GPU detected : rank 1 and rank 2 both on CUDA device 3000"


@pytest.mark.parametrize(
    "change",
    [{"numel": 8, "out_numel": 8}, {"dtype": "float16"}, {"op": C.BROADCAST}, {"reduce_op": R.MAX}],
)
def test_mismatch_errors_every_rank(daemon, change):
    g = daemon.group(2)
    for r in g.ranks:
        r.ensure_arena(64)
    args = {"op": C.ALLREDUCE, "numel": 4, "out_numel": 4, "dtype": "float32"}
    reqs = [g.ranks[0].post(**args), g.ranks[1].post(**{**args, **change})]
    for rep, req in zip(g.replies(), reqs):
        assert isinstance(rep, s.Error), rep
        assert rep.req == req and rep.code == "ncclInvalidUsage"
        assert rep.message.startswith("Detected mismatch between collectives on ranks. Rank 0 is running collective:")
        assert "CollectiveFingerPrint(SequenceNumber=1" in rep.message
    if "numel" in change:
        assert "TensorShape=[4]" in rep.message and "TensorShape=[8]" in rep.message
    assert daemon.group(2).run(C.ALLREDUCE, [np.ones(2, np.float32)] * 2)[0].tolist() == [2.0, 2.0]


def test_out_of_order_seq_fails_comm(daemon):
    g = daemon.group(2)
    for r in g.ranks:
        r.ensure_arena(64)
    g.run(C.BARRIER, None)
    a = g.ranks[0]
    a.post(C.BARRIER, 0, seq=1)  # already used
    rep = a.client.recv()
    assert isinstance(rep, s.Error) and "out of order" in rep.message


def test_collective_before_comm_init(daemon):
    g = daemon.group(2, join=False)
    g.ranks[0].ensure_arena(64)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4)
    rep = g.ranks[0].client.recv()
    assert isinstance(rep, s.Error) and rep.code == "ncclInvalidUsage" and "before joining" in rep.message


def test_bad_comm_init(daemon):
    c = daemon.client()
    rep = c.call(s.CommInit(comm="x" * 32, rank=3, size=2))
    assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument"
    assert isinstance(c.call(s.CommInit(comm="y" * 32, rank=0, size=2)), s.Ok)
    rep = c.call(s.CommInit(comm="y" * 32, rank=1, size=3))
    assert isinstance(rep, s.Error) and rep.code == "ncclInvalidUsage"


def test_unsupported_dtype_and_bad_reduce_scatter(daemon):
    for kw in ({"dtype": "complex64"}, {"op": C.REDUCE_SCATTER, "out_numel": 3}, {"dtype": "bool", "reduce_op": R.AVG}):
        g = daemon.group(2)
        for r in g.ranks:
            r.ensure_arena(256)
        args = {"op": C.ALLREDUCE, "numel": 4, "out_numel": 4, "dtype": "float32", **kw}
        for r in g.ranks:
            r.post(**args)
        for rep in g.replies():
            assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument", (kw, rep)


# ---------------------------------------------------------------- hostile input


def test_every_request_type_has_a_handler():
    """The daemon's dispatch table answers every request of the catalogue (a new one without a handler is refused)."""
    from emulator.daemon import _HANDLERS

    assert set(_HANDLERS) == {cls for cls in s.MESSAGE_TYPES.values() if issubclass(cls, s.Request)}


def test_wrong_token_is_refused_and_daemon_keeps_working(daemon):
    c = daemon.client()
    for token in ("", "nope", daemon.token + "x", daemon.token[:-1], daemon.token.upper() + "\u00e9"):
        rep = c.call(s.Ping(), token=token)
        assert isinstance(rep, s.Error) and rep.code == "protocol" and "token" in rep.message
    # a request with a wrong token has no effect: this rank did not join
    g = daemon.group(1, join=False)
    rank = g.ranks[0]
    rank.client.send(s.CommInit(comm=g.comm, rank=0, size=1), token="bad")
    assert rank.client.recv().code == "protocol"
    rank.ensure_arena(64)
    rank.post(C.ALLREDUCE, 4, out_numel=4)
    rep = rank.client.recv()
    assert isinstance(rep, s.Error) and "before joining" in rep.message
    # a collective with a wrong token is not counted as posted
    g2 = daemon.group(2)
    for r in g2.ranks:
        r.ensure_arena(64)
        r.write(0, np.ones(4, np.float32))
    g2.ranks[0].client.send(
        s.Collective(comm=g2.comm, rank=0, seq=1, numel=4, out_numel=4, device=0, arena=g2.ranks[0].arena.name),
        token="bad",
    )
    assert g2.ranks[0].client.recv().code == "protocol"
    outs = g2.run(C.ALLREDUCE, [np.ones(4, np.float32)] * 2)
    np.testing.assert_array_equal(outs[0], np.full(4, 2.0, np.float32))


def _malformed(token: str, n: int) -> list[bytes]:
    gen = random.Random(1234)
    good = json.loads(s.encode(s.Collective(token=token, req=1, comm="c" * 32, numel=4, arena="x")))
    fixed = [
        b"",
        b"\x00",
        b"[]",
        b"1",
        b"null",
        b'"ping"',
        b"true",
        b"{}",
        b"{",
        b"\xff\xfe\x00",
        b'{"v":1}',
        b'{"v":2,"type":"ping"}',
        b'{"type":"ping"}',
        b'{"v":1,"type":"nonsense"}',
        b'{"v":1,"type":["ping"]}',
        b'{"v":1,"type":{"a":1}}',
        b'{"v":1,"type":"ok","req":1}',
        b'{"v":1,"type":"daemon_ready"}',
        b'{"v":1,"type":"ping","token":5}',
        b'{"v":1,"type":"ping","token":null}',
        b'{"v":1,"type":"ping","req":"7"}',
        b'{"v":1,"type":"ping","req":true}',
        b'{"v":1,"type":"ping","req":1.5}',
        b'{"v":1,"type":"ping","token":"\\ud800"}',
        b'{"v":1,"type":"ping","token":"x"}',
        b'{"v":1,"type":"ping","req":NaN}',
        b'{"v":1,"type":"ping","req":1e999}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b"{" + b" " * (2 << 20) + b"}",  # a 2 MiB frame
        json.dumps({**good, "op": "gather"}).encode(),
        json.dumps({**good, "reduce_op": "xor"}).encode(),
        json.dumps({**good, "numel": "4"}).encode(),
        json.dumps({**good, "rank": [0]}).encode(),
        json.dumps({**good, "dtype": 32}).encode(),
        json.dumps({**good, "op": None}).encode(),
        json.dumps({**good, "op": ["allreduce"]}).encode(),
        json.dumps({**good, "token": "wrong"}).encode(),
    ]
    out = list(fixed)
    fields = list(good)
    junk_values = [None, True, -1, 2**80, 1.5, "", "x" * 300, [], {}, [1, 2], {"k": "v"}, "\u0000", -(2**63)]
    while len(out) < n:
        kind = gen.randrange(4)
        if kind == 0:  # random bytes
            out.append(bytes(gen.randrange(256) for _ in range(gen.randrange(1, 200))))
        elif kind == 1:  # a well-formed message with one field of the wrong type
            body = dict(good)
            body[gen.choice(fields)] = gen.choice(junk_values)
            body["token"] = body["token"] if isinstance(body["token"], str) and gen.random() < 0.5 else "bad"
            out.append(json.dumps(body).encode())
        elif kind == 2:  # truncated
            raw = s.encode(s.Ping(token=token, req=9))
            out.append(raw[: gen.randrange(len(raw))])
        else:  # non-object JSON
            out.append(json.dumps(gen.choice([[1, 2], 3, "s", None, 2.5, [{"v": 1, "type": "ping"}]])).encode())
    return out[:n]


def test_malformed_messages_each_get_an_error(fresh_daemon):
    d = fresh_daemon
    c = d.client()
    msgs = _malformed("bad-token", 1000)
    assert len(msgs) == 1000
    for i, raw in enumerate(msgs):
        c.send_raw(raw)
        rep = c.recv()
        assert isinstance(rep, s.Error), (i, raw[:80], rep)
        assert rep.code == "protocol", (i, raw[:80], rep)
    # multi-frame messages: refused too
    for frames in ([b"a", b"b"], [s.encode(s.Ping(token=d.token, req=5)), b""], [b""] * 5):
        c.send_raw(*frames)
        rep = c.recv()
        assert isinstance(rep, s.Error) and rep.code == "protocol" and "one frame" in rep.message
    # a socket-transport collective's data frames cut wrong (empty, or short before the last): refused
    head = s.encode(s.Collective(token=d.token, req=6, comm="c" * 32, numel=4, transport=s.Transport.SOCKET))
    for data in ([b""], [b"\0" * 8, b"\0" * 8]):
        c.send_raw(head, *data)
        rep = c.recv()
        assert isinstance(rep, s.Error) and rep.code == "protocol" and "each must be" in rep.message, rep
    assert isinstance(c.call(s.Ping()), s.Ok)
    g = d.group(2)
    outs = g.run(C.ALLREDUCE, [np.arange(8, dtype=np.float32)] * 2)
    np.testing.assert_array_equal(outs[0], np.arange(8, dtype=np.float32) * 2)


def test_malformed_messages_pipelined(fresh_daemon):
    # the same abuse, sent all at once by many clients
    d = fresh_daemon
    clients = [d.client() for _ in range(8)]
    msgs = _malformed(d.token, 400)
    for i, raw in enumerate(msgs):
        clients[i % 8].send_raw(raw)
    for i, c in enumerate(clients):
        for _ in range(len(msgs[i::8])):
            assert isinstance(c.recv(), s.Error)
        assert not c.has_reply(0.05)
    g = d.group(3)
    outs = g.run(C.ALLGATHER, [np.full(2, r, np.int32) for r in range(3)], dtype="int32")
    assert outs[2].tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "/etc/passwd",
        "mirage-deadbeef-r0",
        "mirage-{session}-../../../etc/passwd",
        "mirage-{session}",
        "mirage-{session}-",
        "mirage-{session}-missing",
        "mirage-{session}x-r0",
        "",
    ],
)
def test_arena_outside_session_is_refused(daemon, name):
    name = name.format(session=daemon.session)
    g = daemon.group(2)
    g.ranks[1].ensure_arena(64)
    reqs = [g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4, arena=name), g.ranks[1].post(C.ALLREDUCE, 4, out_numel=4)]
    for rep, req in zip(g.replies(), reqs):
        assert isinstance(rep, s.Error) and rep.req == req and rep.code == "ncclInvalidArgument", rep
    assert os.path.exists("/etc/passwd")
    assert daemon.group(1).run(C.BROADCAST, [np.ones(3, np.float32)])[0].tolist() == [1.0, 1.0, 1.0]


def test_other_sessions_arena_is_refused_even_if_it_exists(daemon):
    other = "0123abcd" if daemon.session != "0123abcd" else "0123abce"
    foreign = daemon.track(Arena.create(arena_name(other, "r0"), 64))
    foreign.bytes_view(0, 16).view(np.float32)[:] = 7.0
    g = daemon.group(1)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4, arena=foreign.name)
    rep = g.ranks[0].client.recv()
    assert isinstance(rep, s.Error) and "not a shared-memory segment of session" in rep.message
    assert foreign.bytes_view(0, 16).view(np.float32).tolist() == [7.0] * 4


def test_out_of_bounds_offsets_are_refused(daemon):
    for kw in ({"in_off": 60}, {"in_off": -4}, {"out_off": 1 << 40}, {"numel": 1 << 50, "out_numel": 1 << 50}):
        g = daemon.group(1)
        g.ranks[0].ensure_arena(64)  # 4096 bytes at least
        args = {"numel": 4, "out_numel": 4, "in_off": 0, "out_off": 16, **kw}
        if "in_off" in kw and kw["in_off"] == 60:
            args["numel"] = args["out_numel"] = 1024
        g.ranks[0].post(C.ALLREDUCE, **args)
        rep = g.ranks[0].client.recv()
        assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument" and "outside arena" in rep.message, rep


@pytest.mark.parametrize("fast", [False, True], ids=["zeromq", "fast-socket"])
def test_vanished_client_does_not_block_daemon(fresh_daemon, fast):
    d = fresh_daemon
    g = d.group(2, join=False)
    if fast:
        g.ranks[0].client.close()
        g.ranks[0].client = FastClient(d)
    g.join()
    for r in g.ranks:
        r.ensure_arena(64)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4)
    g.ranks[0].client.close()  # rank 0 dies waiting
    g.ranks[1].post(C.ALLREDUCE, 4, out_numel=4)
    assert isinstance(g.ranks[1].client.recv(), s.Done)
    assert isinstance(d.client().call(s.Ping()), s.Ok)


def test_daemon_stops_cleanly_on_sigterm():
    d = DaemonProcess()
    try:
        d.group(2).run(C.BARRIER, None)
        d.proc.terminate()
        assert d.proc.wait(TIMEOUT_S) == 0
        assert "Traceback" not in d.stderr()
    finally:
        d.stop()


def test_events_are_valid_messages(daemon):
    ev = Events(daemon)
    try:
        g = daemon.group(2)
        g.run(C.ALLREDUCE, [np.ones(4, np.float32)] * 2)
        bad = daemon.client()
        bad.send_raw(b"junk")
        bad.recv()
        got = ev.until(lambda e: isinstance(e, s.ProtocolError))
    finally:
        ev.close()
    types = [e.TYPE for e in got]
    for t in ("comm_joined", "coll_enqueued", "coll_started", "coll_completed", "protocol_error"):
        assert t in types
    assert isinstance(got[-1], s.ProtocolError) and "malformed" in got[-1].message


def test_device_outside_the_node_is_refused(daemon):
    """A collective on a GPU the node does not have fails its communicator; the daemon lives on."""
    g = daemon.group(2, devices=[0, 7])
    for r in g.ranks:
        r.ensure_arena(64)
    for r in g.ranks:
        r.post(C.ALLREDUCE, 4, out_numel=4)
    for rep in g.replies():
        assert isinstance(rep, s.Error), rep
        assert rep.message == "device 7 is not one of this node's 4 GPUs"
    ok = daemon.group(2)
    outs = ok.run(C.ALLREDUCE, [np.ones(4, np.float32)] * 2)
    np.testing.assert_array_equal(outs[0], np.full(4, 2.0, np.float32))


# ---------------------------------------------------------------- the fast socket


def test_fast_socket_answers_and_refuses_as_zeromq_does(daemon):
    c = FastClient(daemon)
    assert isinstance(c.call(s.Ping()), s.Ok)
    rep = c.call(s.Ping(), token="nope")
    assert isinstance(rep, s.Error) and rep.code == "protocol" and "token" in rep.message
    for raw, why in ((b"{", "malformed"), (b"x" * (s.FAST_MAX_MESSAGE_BYTES + 1), "longer than")):
        c.send_raw(raw)
        rep = c.recv()
        assert isinstance(rep, s.Error) and rep.code == "protocol" and why in rep.message, rep
    assert isinstance(c.call(s.Ping()), s.Ok)
    c.close()


def test_fast_socket_and_zeromq_ranks_share_a_communicator(daemon):
    g = daemon.group(3, join=False)
    g.ranks[1].client.close()
    g.ranks[1].client = FastClient(daemon)
    g.join()
    for i in range(5):  # in order, several times: each rank's replies come on its own channel
        xs = [rng(i * 3 + r).integers(-1000, 1000, 257).astype(np.float32) for r in range(3)]
        outs = g.run(C.ALLREDUCE, xs)
        for out in outs:
            np.testing.assert_array_equal(out, xs[0] + xs[1] + xs[2])


# ---------------------------------------------------------------- registered buffers (zero-copy)


def _memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A shared-memory file of ``nbytes`` (as torch's shared storages are) and our mapping of it."""
    fd = os.memfd_create(name)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def _fd_targets(d) -> list[str]:
    """What the daemon's open descriptors point at."""
    out = []
    for n in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{d.proc.pid}/fd/{n}"))
        except FileNotFoundError:  # closed meanwhile
            pass
    return sorted(out)


def _daemon_maps(d, name: str) -> int:
    """How many of the daemon's mappings are of the memfd ``name``."""
    with open(f"/proc/{d.proc.pid}/maps") as f:
        return sum(f"/memfd:{name} " in line for line in f)


def test_collectives_run_in_registered_buffers(fresh_daemon):
    d = fresh_daemon
    g = fast_group(d, 2)
    n = 1000
    xs = [rng(r).integers(-100, 100, n).astype(np.float32) for r in range(2)]
    # rank 0 lends a tensor's storage (the data at byte offset 256 of it); rank 1 stages in its arena
    fd, m = _memfd("mirage-test-buf", 256 + n * 4)
    view = np.frombuffer(m, np.float32, n, 256)
    view[:] = xs[0]
    req = g.ranks[0].client.send_fds(s.RegisterBuffer(buf=7, nbytes=256 + n * 4), [fd])
    os.close(fd)  # the daemon has its own descriptor (closed) and mapping
    assert isinstance(rep := g.ranks[0].client.recv(), s.Ok) and rep.req == req, rep
    assert _daemon_maps(d, "mirage-test-buf") == 1
    g.ranks[1].ensure_arena(n * 4)
    g.ranks[1].write(0, xs[1])
    for k in range(3):  # in place, again and again
        g.ranks[0].post(C.ALLREDUCE, n, out_numel=n, in_buf=7, out_buf=7, in_off=256, out_off=256)
        g.ranks[1].post(C.ALLREDUCE, n, out_numel=n)
        assert all(isinstance(r, s.Done) for r in g.replies())
    want = (xs[0] + xs[1]) * 4
    np.testing.assert_array_equal(view, want)
    np.testing.assert_array_equal(g.ranks[1].read(0, n, np.float32), want)
    # broadcast from the registered buffer's rank; then the buffer receives one
    g.ranks[1].write(0, xs[1])
    g.ranks[0].post(C.BROADCAST, n, out_numel=n, root=1, in_buf=7, out_buf=7, in_off=256, out_off=256)
    g.ranks[1].post(C.BROADCAST, n, out_numel=n, root=1)
    assert all(isinstance(r, s.Done) for r in g.replies())
    np.testing.assert_array_equal(view, xs[1])
    # released: the daemon unmaps it, and a collective naming it fails cleanly
    g.ranks[0].client.send(s.ReleaseBuffers(bufs=[7, 99]))
    assert isinstance(g.ranks[0].client.recv(), s.Ok)
    assert _daemon_maps(d, "mirage-test-buf") == 0
    g.ranks[0].post(C.ALLREDUCE, n, out_numel=n, in_buf=7, out_buf=7, in_off=256, out_off=256)
    g.ranks[1].post(C.ALLREDUCE, n, out_numel=n)
    for rep in g.replies():
        assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument" and "not registered" in rep.message, rep
    del view
    m.close()


def test_registered_buffers_go_with_their_connection(fresh_daemon):
    d = fresh_daemon
    c = FastClient(d)
    for buf in (1, 2):
        fd, m = _memfd(f"mirage-test-conn{buf}", 4096)
        c.send_fds(s.RegisterBuffer(buf=buf, nbytes=4096), [fd])
        os.close(fd)
        m.close()
        assert isinstance(c.recv(), s.Ok)
    assert _daemon_maps(d, "mirage-test-conn1") == _daemon_maps(d, "mirage-test-conn2") == 1
    c.close()
    assert isinstance(d.client().call(s.Ping()), s.Ok)  # (the daemon has read the close by now)
    assert _daemon_maps(d, "mirage-test-conn1") == _daemon_maps(d, "mirage-test-conn2") == 0


def test_bad_registrations_and_references_get_error_replies(fresh_daemon):
    d = fresh_daemon
    c = FastClient(d)
    fd, m = _memfd("mirage-test-bad", 4096)
    r, w = os.pipe()
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    cases = [
        (s.RegisterBuffer(buf=1, nbytes=4096), [], "exactly one file descriptor"),
        (s.RegisterBuffer(buf=1, nbytes=4096), [fd, fd], "exactly one file descriptor"),
        (s.RegisterBuffer(buf=1, nbytes=4096), [r], "not a shared-memory file"),
        (s.RegisterBuffer(buf=1, nbytes=8192), [fd], "its file holds 4096"),
        (s.RegisterBuffer(buf=1, nbytes=0), [fd], "must be positive"),
        (s.RegisterBuffer(buf=-3, nbytes=4096), [fd], "must be positive"),
        (s.RegisterBuffer(buf=1, nbytes=4096), [ro], "cannot map"),
        (s.RegisterBuffer(buf=1, nbytes=1 << 60), [fd], "may have registered"),
    ]
    for msg, fds, why in cases:
        req = c.send_fds(msg, fds) if fds else c.send(msg)
        rep = c.recv()
        assert isinstance(rep, s.Error) and rep.req == req and rep.code == "ncclInvalidArgument", (msg, rep)
        assert why in rep.message, (why, rep.message)
    # descriptors sent with a message that takes none are closed, not leaked
    before = _fd_targets(d)
    for _ in range(20):
        c.send_fds(s.Ping(), [fd])
        assert isinstance(c.recv(), s.Ok)
    deadline = time.monotonic() + 2  # (one the daemon holds for a moment, e.g. a /proc read, goes)
    while len(after := _fd_targets(d)) > len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(after) <= len(before), (before, after)
    assert _daemon_maps(d, "mirage-test-bad") == 0
    c.send_fds(s.RegisterBuffer(buf=1, nbytes=4096), [fd])
    assert isinstance(c.recv(), s.Ok)
    c.send_fds(s.RegisterBuffer(buf=1, nbytes=4096), [fd])
    rep = c.recv()
    assert isinstance(rep, s.Error) and "already registered" in rep.message
    # over ZeroMQ no descriptor can come
    rep = d.client().call(s.RegisterBuffer(buf=2, nbytes=4096))
    assert isinstance(rep, s.Error) and "exactly one file descriptor" in rep.message
    # a collective naming an unknown buffer, or a range outside it, fails its communicator cleanly
    for kw, why in (({"in_buf": 5, "out_buf": 5}, "not registered"),
                    ({"in_buf": 1, "out_buf": 1, "in_off": 4040, "out_off": 4040}, "outside buffer"),
                    ({"in_buf": 1, "out_buf": 1, "in_off": -8, "out_off": -8}, "outside buffer")):
        g = fast_group(d, 2)
        g.ranks[1].ensure_arena(64)
        g.ranks[0].client.close()
        g.ranks[0].client = c  # the connection that registered buffer 1
        g.ranks[0].post(C.ALLREDUCE, 16, out_numel=16, **kw)
        g.ranks[1].post(C.ALLREDUCE, 16, out_numel=16)
        for rep in g.replies():
            assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument" and why in rep.message, rep
    for x in (r, w, ro, fd):
        os.close(x)
    m.close()


def _sleepers(n: int) -> list:
    """``n`` processes that wait to be killed; the test does not reap them, so they stay zombies once dead."""
    import subprocess

    return [subprocess.Popen(["sleep", "60"]) for _ in range(n)]


def test_first_rank_to_go_is_named_first_even_when_its_launcher_ends_the_rest_at_once(fresh_daemon):
    """Rank 1 is killed and its launcher terminates rank 0 within the same millisecond (torchrun's teardown):
    the daemon reports rank 1 gone first, the rank the session then names as the cause."""
    import signal

    procs = _sleepers(2)
    events = Events(fresh_daemon)
    c = fresh_daemon.client()
    try:
        for rank, proc in enumerate(procs):
            assert isinstance(c.call(s.Hello(rank=rank, node=0, pid=proc.pid)), s.Ok)
        procs[1].send_signal(signal.SIGKILL)
        procs[0].send_signal(signal.SIGTERM)
        seen: list[s.Event] = []
        gone: list[int] = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(gone) < 2 and time.monotonic() < deadline:
            seen += events.drain(0.5)
            gone = [e.rank for e in seen if isinstance(e, s.RankGone)]
        assert gone == [1, 0]
    finally:
        events.close()
        for proc in procs:
            proc.kill()
            proc.wait()


def _until_zombie(proc) -> None:
    """Wait until ``proc`` (a child not yet reaped) has ended: its /proc state is Z."""
    deadline = time.monotonic() + TIMEOUT_S
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_rank_its_launcher_terminated_waits_briefly_for_the_rank_that_died_first():
    """Found alone, a rank a teardown signal ended is held back (TEARDOWN_GRACE_S) for the death that caused the
    teardown, which the kernel may finish a moment later; then it is reported all the same."""
    import signal

    from emulator.ranks import TEARDOWN_GRACE_S, RankProcesses

    watched: list[int] = []
    books = RankProcesses("here", watch=watched.append, unwatch=watched.remove)
    terminated, killed, alone = procs = _sleepers(3)
    try:
        for rank, proc in enumerate(procs):
            books.register(rank, proc.pid, "")
        terminated.send_signal(signal.SIGTERM)
        _until_zombie(terminated)
        assert books.exited() == []  # held: no other rank gone yet
        assert len(watched) == 2  # and its pidfd out of the poller meanwhile (it would stay ready)
        killed.kill()
        _until_zombie(killed)
        assert books.exited() == [(1, killed.pid), (0, terminated.pid)]
        books.gone(1, "killed")
        books.gone(0, "terminated")
        alone.send_signal(signal.SIGTERM)  # nothing else dies: reported once the grace is over
        _until_zombie(alone)
        assert books.exited() == []
        time.sleep(TEARDOWN_GRACE_S)
        assert books.exited() == [(2, alone.pid)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_rank_killed_while_the_daemon_waits_is_seen_through_its_pidfd():
    """The daemon sleeps in its poller; a rank's death wakes it (its pidfd), not the next scan."""
    import select

    from emulator.ranks import RankProcesses

    watched: list[int] = []
    books = RankProcesses("here", watch=watched.append, unwatch=watched.remove)
    (proc,) = _sleepers(1)
    try:
        books.register(0, proc.pid, "")
        (fd,) = watched
        assert books.is_pidfd(fd) and books.exited() == []
        assert select.select([fd], [], [], 0)[0] == []
        proc.kill()
        assert select.select([fd], [], [], TIMEOUT_S)[0] == [fd]
        assert books.exited() == [(0, proc.pid)]
        books.gone(0, "killed")
        assert watched == [] and not books.is_pidfd(fd)
    finally:
        proc.kill()
        proc.wait()


def test_ranks_found_gone_together_put_the_one_a_launcher_terminated_last():
    """Found in one check, both dead: the SIGTERMed rank 0 (a teardown) after the SIGKILLed rank 1."""
    import signal

    from emulator.ranks import RankProcesses

    books = RankProcesses("here", watch=lambda fd: None, unwatch=lambda fd: None)
    procs = _sleepers(2)
    try:
        procs[0].send_signal(signal.SIGTERM)  # first in time, and still the effect, not the cause
        procs[1].send_signal(signal.SIGKILL)
        for rank, proc in enumerate(procs):
            books.register(rank, proc.pid, "")
        deadline = time.monotonic() + TIMEOUT_S
        while len(books.exited()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [rank for rank, _ in books.exited()] == [1, 0]
    finally:
        books.close()
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_daemon_raises_its_open_files_limit_to_the_hard_one():
    """About three descriptors a rank: a soft limit of 1024, common, would stop a daemon short of 350 ranks."""
    import resource
    import subprocess
    import sys

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit on open files here is {hard}")
    code = ("import resource; from emulator.__main__ import _open_files_to_hard_limit; "
            "_open_files_to_hard_limit(); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert int(out.stdout) > 256
