"""Small collectives rank to rank (``shim/transport/direct.py``): the rings, the daemon's books, deferred requests,
and real torch ranks through ``mirage run``."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
from daemon_client import TIMEOUT_S, Events, FastClient, fast_group, stamped

from shim.rank.runtime import RUNTIME
from shim.transport import direct
from wire import schema as s
from wire.arena import session_segments

C = s.CollOp
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ml")


# ---------------------------------------------------------------- the rings, in one process


@pytest.fixture
def rings():
    """``make(size)``: every rank's view of one fresh communicator's rings; their files removed afterwards."""
    session = secrets.token_hex(4)

    def make(size: int) -> list[direct.PeerRings]:
        comm = uuid.uuid4().hex
        return [direct.PeerRings(session, comm, r, size) for r in range(size)]

    yield make
    for path in session_segments(session):
        os.unlink(path)


def test_every_rank_reads_every_input_and_slots_come_round(rings):
    ranks = rings(3)
    for index in range(1, 3 * direct.SLOTS + 2):
        sent = [np.arange(5, dtype=np.float32) * (index + 10 * r) for r in range(3)]
        for r, pr in enumerate(ranks):
            assert pr.slot_free(index)
            assert pr.post(index + 1, C.ALLREDUCE, "float32", 5, s.ReduceOp.SUM, 0, sent[r].data) == index
        for pr in ranks:
            assert pr.arrived(index) and pr.matches(index)
            got = [x.view(np.float32) for x in pr.inputs(index, 20)]
            for g, want in zip(got, sent):
                np.testing.assert_array_equal(g, want)
        for pr in ranks:
            pr.finish(index)


def test_a_slot_is_free_again_only_once_every_rank_finished_its_last_use(rings):
    a, b = rings(2)
    for index in range(1, direct.SLOTS + 1):
        for pr in (a, b):
            pr.post(index + 1, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)
    nxt = direct.SLOTS + 1
    assert not a.slot_free(nxt)
    a.finish(1)
    assert not a.slot_free(nxt)  # b has not read slot 1 yet
    b.finish(1)
    assert a.slot_free(nxt) and b.slot_free(nxt)
    assert not a.slot_free(nxt + 1)


def test_headers_that_differ_do_not_match(rings):
    a, b = rings(2)
    a.post(2, C.ALLREDUCE, "float32", 4, s.ReduceOp.SUM, 0, np.ones(4, np.float32).data)
    b.post(2, C.ALLREDUCE, "float32", 5, s.ReduceOp.SUM, 0, np.ones(5, np.float32).data)
    assert a.arrived(1) and b.arrived(1)  # (which maps the peers' rings)
    assert not a.matches(1) and not b.matches(1)


def test_wait_gives_up_at_its_deadline_and_checks_in_between(rings):
    a, b = rings(2)
    a.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)
    checks = []
    assert not a.wait(1, time.monotonic() + 3 * direct.WAIT_SLICE_S, lambda: checks.append(1))
    assert checks
    b.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)
    assert a.wait(1, time.monotonic() + 1, lambda: None)


def test_wait_stops_when_its_check_raises(rings):
    a, _ = rings(2)
    a.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)

    def check():
        raise RuntimeError("the daemon said no")

    with pytest.raises(RuntimeError, match="the daemon said no"):
        a.wait(1, time.monotonic() + 30, check)


def test_a_waiting_rank_is_woken_by_its_peer(rings):
    a, b = rings(2)
    a.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)
    threading.Timer(0.2, lambda: b.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)).start()
    assert a.wait(1, time.monotonic() + 30, lambda: None)


def test_a_peer_without_a_ring_yet_is_waited_for(rings):
    session = secrets.token_hex(4)
    comm = uuid.uuid4().hex
    a = direct.PeerRings(session, comm, 0, 2)
    try:
        a.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)
        assert not a.arrived(1)
        assert not a.wait(1, time.monotonic() + 0.1, lambda: None)
        b = direct.PeerRings(session, comm, 1, 2)
        b.post(2, C.BARRIER, "float32", 0, s.ReduceOp.SUM, 0, None)
        assert a.wait(1, time.monotonic() + 1, lambda: None)
    finally:
        for path in session_segments(session):
            os.unlink(path)


def test_counters_compare_across_the_wrap():
    assert direct._reached(5, 5) and direct._reached(6, 5) and not direct._reached(4, 5)
    assert direct._reached(2, 0xFFFFFFFF) and not direct._reached(0xFFFFFFFF, 2)


def test_which_collectives_go_rank_to_rank():
    small = RUNTIME.staging.direct_max_bytes
    assert direct.eligible(C.ALLREDUCE, small, "float32", s.ReduceOp.SUM)
    assert direct.eligible(C.BROADCAST, 8, "bfloat16", s.ReduceOp.SUM)
    assert direct.eligible(C.BARRIER, 0, "float32", s.ReduceOp.SUM)
    assert not direct.eligible(C.ALLREDUCE, small + 1, "float32", s.ReduceOp.SUM)
    assert not direct.eligible(C.ALLGATHER, 8, "float32", s.ReduceOp.SUM)
    assert not direct.eligible(C.ALLREDUCE, 8, "complex64", s.ReduceOp.SUM)  # the daemon says why
    assert not direct.eligible(C.ALLREDUCE, 8, "bool", s.ReduceOp.AVG)


def test_a_bad_threshold_is_a_usage_error():
    env = dict(os.environ, MIRAGE_DIRECT_MAX_BYTES="64k")
    r = subprocess.run([sys.executable, "-c", "import shim.transport.direct"], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)), timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "mirage: MIRAGE_DIRECT_MAX_BYTES='64k' is not a byte count; use e.g. 65536, or 0 for off"


# ---------------------------------------------------------------- the daemon keeps the books


def _direct(g, op=C.ALLREDUCE, numel=4, **kw):
    return [r.post(op, numel, out_numel=numel, direct=True, **kw) for r in g.ranks]


def test_a_direct_collective_is_booked_and_published_but_not_answered(daemon):
    ev = Events(daemon)
    g = fast_group(daemon, 2)
    g.run(C.BARRIER, None)
    _direct(g)
    seen = ev.until(lambda e: isinstance(e, s.CollectiveCompleted) and e.comm == g.comm and e.seq == 2)
    assert sum(isinstance(e, s.CollectiveEnqueued) and e.comm == g.comm and e.seq == 2 for e in seen) == 2
    assert any(isinstance(e, s.CollectiveStarted) and e.seq == 2 and e.total_bytes == 16 for e in seen)
    g.ranks[0].client.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        g.ranks[0].client.sock.recv(4096)
    assert g.run(C.ALLREDUCE, [np.ones(2, np.float32)] * 2)[0].tolist() == [2.0, 2.0]  # seq 3 matches next
    ev.close()


def test_only_small_collective_kinds_may_go_rank_to_rank(daemon):
    g = fast_group(daemon, 2)
    req = g.ranks[0].post(C.ALLGATHER, 4, out_numel=8, direct=True)
    rep = g.ranks[0].client.recv()
    assert isinstance(rep, s.Error) and rep.req == req and rep.code == "ncclInvalidArgument"
    assert "cannot go rank to rank" in rep.message


def test_ranks_disagreeing_on_the_path_all_hear_it(daemon):
    g = fast_group(daemon, 2)
    g.run(C.BARRIER, None)
    for r in g.ranks:
        r.ensure_arena(64)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4, direct=True)
    g.ranks[1].post(C.ALLREDUCE, 4, out_numel=4)
    for rep in g.replies():
        assert isinstance(rep, s.Error) and rep.code == "ncclInvalidUsage", rep
        assert "MIRAGE_DIRECT_MAX_BYTES" in rep.message


def test_a_direct_mismatch_is_answered_with_the_mismatch(daemon):
    g = fast_group(daemon, 2)
    g.run(C.BARRIER, None)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4, direct=True)
    g.ranks[1].post(C.ALLREDUCE, 5, out_numel=5, direct=True)
    for rep in g.replies():
        assert isinstance(rep, s.Error) and rep.message.startswith("Detected mismatch between collectives"), rep


def test_one_datagram_may_carry_several_requests(daemon):
    c = FastClient(daemon)
    lines = [stamped(s.Ping(), daemon.token, 1), b"{", stamped(s.Ping(), daemon.token, 3)]
    c.send_raw(b"\n".join(lines))
    got = [c.recv() for _ in range(3)]
    assert [type(r) for r in got] == [s.Ok, s.Error, s.Ok]
    assert [got[0].req, got[2].req] == [1, 3] and "malformed" in got[1].message
    c.close()


# ---------------------------------------------------------------- deferred requests


@pytest.fixture
def client(daemon):
    from shim.rank.client import DaemonClient

    c = DaemonClient("ipc://" + daemon.rpc_endpoint.removeprefix("ipc://"), daemon.token, daemon.session, "t")
    assert c.has_fast
    yield c
    c.close()


def test_deferred_requests_go_out_before_the_next_one(client):
    deferred = [client.defer(s.Ping()) for _ in range(3)]
    assert isinstance(client.request(s.Ping(), timeout_s=TIMEOUT_S), s.Ok)
    # the daemon answers in order: the deferred ones were answered first
    assert all(client.poll(req) for req in deferred)


def test_deferred_requests_go_out_on_their_own(client):
    req = client.defer(s.Ping())
    assert isinstance(client.wait(req, timeout_s=TIMEOUT_S), s.Ok)  # nothing else was sent: the flusher did


def test_a_forked_child_does_not_send_its_parents_deferred_requests(client):
    client.defer(s.Ping())
    pid = os.fork()
    if pid == 0:
        try:
            client.flush()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    req = client.defer(s.Ping())
    client.flush()
    assert isinstance(client.wait(req, timeout_s=TIMEOUT_S), s.Ok)
    time.sleep(0.2)
    # one answer per request: a second for the first would still be in the socket
    client._fast.settimeout(0.2)
    with pytest.raises(TimeoutError):
        client._fast.recv(4096)


# ---------------------------------------------------------------- real ranks


def _mirage_run(tmp_path, ranks: int, fixture: str, *env: str, timeout: float = 300):
    run_env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    env_args = [a for e in env for a in ("--env", e)]
    return subprocess.run(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--gpus-per-node", str(ranks),
         *env_args, "--nproc-per-node", str(ranks), "--", "python", os.path.join(FIXTURES, fixture)],
        env=run_env, capture_output=True, text=True, timeout=timeout,
    )


def _line(out: str, key: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.startswith(f"[0] {key} ")]
    return line.split()[-1]


@pytest.mark.usefixtures("no_orphans")
def test_rank_to_rank_gives_the_daemons_bytes(tmp_path):
    direct_run = _mirage_run(tmp_path / "direct", 3, "direct_check.py")
    assert direct_run.returncode == 0, direct_run.stdout + direct_run.stderr
    daemon_run = _mirage_run(tmp_path / "daemon", 3, "direct_check.py", "MIRAGE_DIRECT_MAX_BYTES=0")
    assert daemon_run.returncode == 0, daemon_run.stdout + daemon_run.stderr
    assert int(_line(direct_run.stdout, "direct_ok")) > 150
    assert int(_line(daemon_run.stdout, "direct_ok")) == 0
    assert _line(direct_run.stdout, "direct_digest") == _line(daemon_run.stdout, "direct_digest")


@pytest.mark.usefixtures("no_orphans")
def test_a_rank_to_rank_collective_times_out_with_the_watchdog_wording(tmp_path):
    r = _mirage_run(tmp_path, 2, "late_rank.py", "LATE_AT=2")
    assert r.returncode != 0
    assert ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, "
            "NumelIn=4, NumelOut=4, Timeout(ms)=2000) ran for") in r.stderr
