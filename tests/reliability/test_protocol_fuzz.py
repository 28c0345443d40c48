"""Fuzz a live daemon's protocol: it answers every malformed message, stays healthy and still computes.

A real ``python -m emulator`` process, ranks played by DEALER sockets of the
test (no torch). ``MIRAGE_FUZZ_MESSAGES`` raises the message count (the default
keeps this file to a few seconds); ``bench/fuzz_daemon.py`` runs the long
version with figures.
"""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import zmq
from daemon_client import DaemonProcess, Events
from protocol_fuzz import Fuzzer

from wire import schema as s
from wire.arena import Arena, arena_name, session_segments
from wire.endpoints import FAST_SOCKET

N_MESSAGES = int(os.environ.get("MIRAGE_FUZZ_MESSAGES", "10000"))
SEEDS = [int(x) for x in os.environ.get("MIRAGE_FUZZ_SEEDS", "8").split(",")]
BATCH = 300  # per client in flight: well under ZeroMQ's 1000-message high-water marks


def fuzz(d: DaemonProcess, seed: int, n: int, clients: int = 4) -> dict[str, int]:
    """Send ``n`` fuzzed messages over ``2 * clients`` sockets; check the refusals; return counts."""
    arenas = [d.track(Arena.create(arena_name(d.session, f"fz-r{i}-g1"), 4096)).name for i in range(4)]
    f = Fuzzer(seed, d.token, d.session, arenas)
    events = Events(d)
    refusers = [d.client() for _ in range(clients)]
    hostiles = [d.client() for _ in range(clients)]
    counts = {"refusable": 0, "hostile": 0, "protocol_events": 0, "hostile_replies": 0}
    try:
        sent = 0
        while sent < n:
            expected = [0] * clients
            for i in range(min(BATCH * clients, n - sent)):
                k = i % clients
                if f.gen.random() < 0.7:
                    refusers[k].send_raw(*f.refusable())
                    expected[k] += 1
                    counts["refusable"] += 1
                else:
                    for frames in f.hostile():
                        hostiles[k].send_raw(*frames)
                    counts["hostile"] += 1
                sent += 1
            for c, want in zip(refusers, expected):
                for _ in range(want):
                    rep = c.recv()
                    assert isinstance(rep, s.Error) and rep.code == "protocol", (seed, rep)
            for c in hostiles:  # answers or not, as the daemon sees fit; read what came
                while c.has_reply():
                    c.sock.recv_multipart()  # a reply, and the output frame a socket-transport Done brings
                    counts["hostile_replies"] += 1
            counts["protocol_events"] += sum(isinstance(e, s.ProtocolError) for e in events.drain(0.0))
        for c in refusers:
            assert not c.has_reply(0.05), "a refused message was answered twice"
        # every refusal is logged as an event (events.jsonl, once a session records them)
        counts["protocol_events"] += sum(isinstance(e, s.ProtocolError) for e in events.drain(0.5))
        assert counts["protocol_events"] == counts["refusable"], counts
    finally:
        events.close()
    return counts


def assert_healthy(d: DaemonProcess) -> None:
    """Alive, nothing raised inside it, and a real collective computes the right answer."""
    assert d.alive(), d.stderr()
    assert "Traceback" not in d.stderr(), d.stderr()[-3000:]
    # the fuzz's Hellos claimed global ranks 0..3 for pids that died (the daemon then fails any
    # communicator waiting on them, as it should): register them again, as restarted ranks do
    c = d.client()
    for rank in range(3):
        assert isinstance(c.call(s.Hello(rank=rank, pid=os.getpid())), s.Ok)
    g = d.group(3)
    outs = g.run(s.CollOp.ALLREDUCE, [np.full(1000, r + 1, np.float32) for r in range(3)])
    for out in outs:
        np.testing.assert_array_equal(out, np.full(1000, 6.0, np.float32))
    outs = g.run(s.CollOp.ALLGATHER, [np.full(2, r, np.int64) for r in range(3)], dtype="int64")
    assert outs[1].tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_ten_thousand_fuzzed_messages(seed):
    # a short hang timeout, so the hang detector scans the fuzzed communicators too
    d = DaemonProcess(hang_timeout_s=0.2)
    try:
        counts = fuzz(d, seed, N_MESSAGES)
        assert counts["refusable"] + counts["hostile"] == N_MESSAGES
        # daemon.log names the first 20 refusals, then one per thousand: a flood leaves a short log
        assert d.stderr().count("mirage daemon: refused request #") == 20 + counts["refusable"] // 1000
        assert_healthy(d)
        # fuzzing must not make the daemon hoard memory (its baseline is ~50 MiB)
        assert psutil.Process(d.proc.pid).memory_info().rss < 400 << 20
    finally:
        d.stop()
    assert not session_segments(d.session)


def test_frame_over_the_transport_limit_drops_the_connection_not_the_daemon():
    """A frame too big to buffer (64 MiB) is cut off by ZeroMQ; the daemon goes on, and so can the client."""
    d = DaemonProcess()
    try:
        c = d.client()
        c.send_raw(b"{" + b" " * (64 << 20) + b"}")
        assert not c.has_reply(1.0)
        assert d.alive()
        # the client's socket reconnects on its own: its next request is answered
        c.sock.setsockopt(zmq.RCVTIMEO, 100)
        reply = c.call(s.Ping(), timeout_s=10)
        assert isinstance(reply, s.Ok)
        assert psutil.Process(d.proc.pid).memory_info().rss < 200 << 20
        assert_healthy(d)
    finally:
        d.stop()


def test_huge_communicator_is_refused_and_the_hang_scan_stays_cheap():
    """A communicator of 2**40 ranks used to freeze the daemon: the hang scan walked every rank."""
    d = DaemonProcess(hang_timeout_s=0.2)
    try:
        arena = d.track(Arena.create(arena_name(d.session, "big-r0-g1"), 4096))
        c = d.client()
        for size in (2**40, 0, -1, (1 << 16) + 1):
            rep = c.call(s.CommInit(comm="b" * 32, rank=0, size=size))
            assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument" and "outside 1..65536" in rep.message
        # the largest allowed one, half posted: the hang scan runs over it and the daemon still answers
        assert isinstance(c.call(s.CommInit(comm="c" * 32, rank=0, size=1 << 16)), s.Ok)
        events = Events(d)  # subscribed before the hang can be published
        try:
            c.send(s.Collective(comm="c" * 32, seq=1, rank=0, numel=4, out_numel=4, arena=arena.name))
            hang = events.until(lambda e: isinstance(e, s.HangDetected))[-1]
        finally:
            events.close()
        assert hang.joined == [0] and len(hang.missing) == (1 << 16) - 1
        assert isinstance(c.call(s.Ping(), timeout_s=2), s.Ok)
        assert_healthy(d)
    finally:
        d.stop()


def assert_lets_go(daemon: psutil.Process, fds: int) -> None:
    """The daemon's descriptors come back to within 20 of ``fds``: it let go of connections that went away."""
    deadline = time.monotonic() + 10
    while daemon.num_fds() > fds + 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.num_fds() <= fds + 20, (fds, daemon.num_fds())


def test_connection_churn_leaks_nothing():
    """500 clients that connect, send (a good ping, a bad one, junk) and vanish without reading the reply."""
    d = DaemonProcess()
    try:
        daemon = psutil.Process(d.proc.pid)
        events = Events(d)
        fds = daemon.num_fds()
        for i in range(500):
            sock = d.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, -1)  # closed at once; ZeroMQ still delivers what was sent
            sock.connect(d.rpc_endpoint)
            sock.send([s.encode(s.Ping(token=d.token, req=i)), s.encode(s.Ping(token="bad", req=i)), b"\xff"][i % 3])
            sock.close()
        assert d.alive()
        # every message arrived: the bad ones were refused and logged (333 of the 500)
        refused, deadline = 0, time.monotonic() + 10
        while refused < 333 and time.monotonic() < deadline:
            refused += sum(isinstance(e, s.ProtocolError) for e in events.drain(0.2))
        events.close()
        assert refused == 333
        assert_lets_go(daemon, fds)
        assert_healthy(d)
    finally:
        d.stop()


def test_fuzzed_messages_and_churn_on_the_fast_socket():
    """The fast socket (fast.sock, one datagram per request) refuses what ZeroMQ refuses, and lets go of
    connections that vanish: 3,000 fuzzed datagrams, then 300 clients that send and close unread."""
    import socket

    d = DaemonProcess(hang_timeout_s=0.2)
    try:
        daemon = psutil.Process(d.proc.pid)
        fds = daemon.num_fds()
        path = os.path.join(d.run_dir, FAST_SOCKET)
        arenas = [d.track(Arena.create(arena_name(d.session, f"ff-r{i}-g1"), 4096)).name for i in range(4)]
        f = Fuzzer(11, d.token, d.session, arenas, big=False)
        refuser = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        refuser.connect(path)
        refuser.settimeout(10)
        hostile = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        hostile.connect(path)
        hostile.setblocking(False)
        refused = 0
        for _ in range(3000):
            if f.gen.random() < 0.7:
                frames = f.refusable()
                if len(frames) != 1 or not frames[0]:
                    # a datagram is one message (multi-frame messages are ZeroMQ's to refuse), and an
                    # empty one reads as the end of the connection (checked below)
                    continue
                refuser.send(frames[0])
                rep = s.decode(refuser.recv(s.MAX_MESSAGE_BYTES))
                assert isinstance(rep, s.Error) and rep.code == "protocol", rep
                refused += 1
            else:
                for message in f.hostile():
                    if len(message) == 1:  # those with data frames are socket-transport requests: ZeroMQ's
                        hostile.send(message[0])
                while True:  # read what came back, answers or errors as the daemon sees fit
                    try:
                        hostile.recv(s.MAX_MESSAGE_BYTES)
                    except BlockingIOError:
                        break
        assert refused > 1500
        refuser.close()
        hostile.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        sock.settimeout(10)
        sock.send(b"")
        assert sock.recv(s.MAX_MESSAGE_BYTES) == b""  # the daemon hung up on that connection only
        sock.close()
        for i in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(path)
            sock.send([s.encode(s.Ping(token=d.token, req=i)), s.encode(s.Ping(token="bad", req=i)), b"\xff"][i % 3])
            sock.close()
        assert_lets_go(daemon, fds)
        assert_healthy(d)
    finally:
        d.stop()
    assert not session_segments(d.session)
