"""The run's fold (mirage_tui/state/runstate.py) on its own: rank and node states, and what each event changed.

No Textual and no processes: the screens draw these words, batch mode's session
and ``mirage status`` keep the same fold.
"""

from __future__ import annotations

from pathlib import Path

from mirage_tui.reports import report
from mirage_tui.state import rank_summary
from mirage_tui.state.runstate import Changed, Outcome, RunState
from wire import schema as s

HANG_RUN = Path(__file__).resolve().parent / "fixtures" / "runs" / "hang-2gpu"
TRACEBACK = "[rank1]: Traceback (most recent call last):"


def _started() -> RunState:
    """Two ranks on one node, in one communicator."""
    state = RunState()
    for e in (s.DaemonReady(t=10.0, nodes=1),
              s.RankRegistered(t=11.0, rank=1, node=0, pid=101),
              s.RankRegistered(t=11.5, rank=0, node=0, pid=100),
              *(s.CommJoined(t=12.0, comm="c" * 16, rank=r, size=2, global_rank=r) for r in (0, 1))):
        state.apply(e)
    return state


def test_a_compiling_rank_reads_compiling_until_its_compilation_ends():
    state = _started()
    assert state.apply(s.RankCompiling(t=12.5, rank=1, pid=101, compiling=True)) == Changed.RANKS
    assert [state.rank_state(r) for r in (0, 1)] == ["running", "compiling"]
    assert rank_summary.summarize(state).counts["compiling"] == 1
    state.apply(s.RankCompiling(t=13.0, rank=1, pid=101, compiling=False))
    assert state.rank_state(1) == "running"


def test_rank_states_from_running_to_how_they_ended():
    state = RunState()
    assert state.apply(s.DaemonReady(t=10.0, nodes=2)) == Changed.RANKS
    assert state.node_state(1) == "starting" and not state.registered
    state = _started()
    assert state.node_state(0) == "" and list(state.registered) == [0, 1] and state.began_at == 10.0
    changed = state.apply(s.CollectiveEnqueued(t=13.0, comm="c" * 16, seq=1, rank=0, numel=4, device=0))
    assert changed == Changed.LEDGER | Changed.RANKS
    assert [state.rank_state(r) for r in (0, 1)] == ["in collective", "running"]
    assert state.ranks[0].gpus == {0}
    state.apply(s.HangDetected(t=20.0, comm="c" * 16, seq=1, joined=[0], missing=[1]))
    assert [state.rank_state(r) for r in (0, 1)] == ["stuck", "missing"]
    assert [f.kind for f in state.findings] == ["hang"]
    # a traceback on stderr, then gone: failed; its node exiting non-zero leaves the other merely exited
    assert state.apply(s.OutputLine(t=21.0, rank=1, stream=s.Stream.STDERR, text=TRACEBACK)) == Changed.NOTHING
    state.apply(s.RankGone(t=22.0, rank=1, pid=101))
    state.apply(s.ProcessExited(t=23.0, node=0, pid=99, returncode=1))
    assert [state.rank_state(r) for r in (0, 1)] == ["exited", "failed"]
    assert state.node_state(0) == "exit 1" and state.ranks[1].ended_at == 22.0 and state.ranks[0].ended_at == 23.0
    assert state.last_output[1] == (TRACEBACK, 21.0)


def test_node_exit_0_clears_a_handled_traceback_and_a_kill_fails_the_rank():
    state = _started()
    state.apply(s.OutputLine(t=13.0, rank=1, stream=s.Stream.STDERR, text=TRACEBACK))
    state.rank_killed(0)
    assert state.rank_state(0) == "failed"
    state.apply(s.ProcessExited(t=14.0, node=0, pid=99, returncode=0))
    assert [state.rank_state(r) for r in (0, 1)] == ["exited 0", "exited 0"]


def test_a_rank_launched_directly_fails_with_its_node_process():
    state = _started()
    state.apply(s.ProcessExited(t=14.0, node=0, pid=101, returncode=3))  # rank 1's own process
    assert [state.rank_state(r) for r in (0, 1)] == ["exited", "failed"]


def test_a_hang_names_a_rank_before_it_registers():
    state = RunState()
    state.apply(s.HangDetected(t=5.0, kind=s.HangKind.WORLD, comm="w", joined=[0], missing=[1]))
    assert not state.registered
    state.apply(s.RankRegistered(t=6.0, rank=1, node=0, pid=7))
    assert state.rank_state(1) == "missing"


def test_report_of_a_recorded_hang():
    state = RunState.from_journal(str(HANG_RUN / "events.jsonl"))
    assert state.ended is not None
    text = report.render(state, Outcome(state.ended.returncode, state.ended.summary, "RUN"), "RUN")
    assert text.startswith("run FAILED: exit 124") and "missing ranks {1}" in text
    assert "  rank 0  node 0  pid " in text and "log RUN/rank-1.log" in text
    assert {state.rank_state(r) for r in state.registered} == {"exited"}


def _named() -> RunState:
    """Four ranks: the default group, and two mesh_tp groups that share torch's name."""
    state = RunState()
    groups = (("d" * 32, "0", "default_pg", [0, 1, 2, 3]), ("a" * 32, "1", "mesh_tp", [0, 1]),
              ("b" * 32, "2", "mesh_tp", [2, 3]), ("e" * 32, "3", "undefined", [1, 3]))
    for comm, name, desc, ranks in groups:
        for r, g in enumerate(ranks):
            state.apply(s.CommJoined(t=1.0, comm=comm, rank=r, size=len(ranks), global_rank=g, name=name, desc=desc))
    return state


def test_communicators_are_named_as_torch_names_them():
    state = _named()
    assert [state.comm_label(c) for c in state.comms] == [
        "default_pg", "mesh_tp (aaaaaaaa)", "mesh_tp (bbbbbbbb)", "group 3"]
    assert state.comms["d" * 32].title == "default_pg (dddddddd)"
    # an unknown communicator, or one a journal recorded before names were carried: its id's first characters
    assert state.comm_label("f" * 32) == "ffffffff"
    state.apply(s.CommJoined(t=2.0, comm="0123456789abcdef", rank=0, size=1, global_rank=0))
    assert state.comm_label("0123456789abcdef") == "01234567" == state.comms["0123456789abcdef"].title
    # alerts and findings say it the same way
    state.apply(s.HangDetected(t=3.0, comm="a" * 32, seq=2, joined=[0], missing=[1]))
    state.apply(s.StragglerWarning(t=3.0, comm="d" * 32, rank=2, count=5, mean_margin_s=0.3))
    state.apply(s.CommFailed(t=4.0, comm="e" * 32, code="ncclInvalidUsage", message="Detected mismatch"))
    assert [f.text.split(":")[0] for f in state.findings] == [
        "collective #2 (allreduce) of mesh_tp (aaaaaaaa)", "rank 2 arrived last at 5 collectives in a row of "
        "default_pg, 0.30 s behind on average", "communicator group 3"]
    assert "communicator mesh_tp (bbbbbbbb): 2 ranks, shm" in state.ledger_table()
    doc = state.to_json()["a" * 32]
    assert (doc["name"], doc["desc"], doc["label"]) == ("1", "mesh_tp", "mesh_tp (aaaaaaaa)")


def test_per_communicator_figures_and_peak_memory():
    state = _named()
    comm = "d" * 32
    # three collectives: rank 2 posts last at the first two (0.5 s and 0.2 s after the first rank), rank 0 at
    # the third; a point-to-point message counts as carried but neither as waiting nor as arriving last
    posts = {1: (0.0, 0.1, 0.5, 0.3), 2: (0.0, 0.0, 0.2, 0.1), 3: (0.4, 0.0, 0.1, 0.0)}
    for seq, offsets in posts.items():
        base = 10.0 * seq
        for r, dt in enumerate(offsets):
            state.apply(s.CollectiveEnqueued(t=base + dt, comm=comm, seq=seq, rank=r, numel=16))
        start = base + max(offsets)
        state.apply(s.CollectiveStarted(t=start, comm=comm, seq=seq, total_bytes=64))
        state.apply(s.CollectiveCompleted(t=start + 0.01, comm=comm, seq=seq, total_bytes=64))
    state.apply(s.CollectiveEnqueued(t=40.0, comm=comm, seq=1, rank=0, op=s.CollOp.SEND, numel=4))
    state.apply(s.CollectiveStarted(t=41.0, comm=comm, seq=1, op=s.CollOp.SEND, total_bytes=16))
    state.apply(s.CollectiveCompleted(t=41.0, comm=comm, seq=1, op=s.CollOp.SEND, total_bytes=16))
    c = state.comms[comm]
    assert (c.collectives, c.bytes_done) == (4, 3 * 64 + 16)
    waits = sum(max(offsets) - dt for offsets in posts.values() for dt in offsets)  # every rank's, to the start
    assert abs(c.wait_s - waits) < 1e-9 and abs(waits - 2.7) < 1e-9 and not c.arriving
    assert c.slowest_rank == 2 and c.last_arrivals == {2: 2, 0: 1}
    doc = state.to_json()[comm]
    assert (doc["collectives"], doc["bytes"], doc["slowest_rank"], doc["last_arrivals"]) == (
        4, 208, 2, {"0": 1, "2": 2})
    # peak GPU memory per rank: the largest peak (or allocation, after a reset of the peak) any GPU reported
    state.apply(s.MemoryUsage(t=50.0, rank=1, device=1, allocated=100, peak=300, total=1 << 30))
    state.apply(s.MemoryUsage(t=51.0, rank=1, device=1, allocated=50, peak=50, total=1 << 30))
    state.apply(s.MemoryUsage(t=52.0, rank=1, device=2, allocated=400, peak=200, total=1 << 30))
    assert state.ranks[1].peak_memory == 400 and state.ranks[0].peak_memory == 0
    state.apply(s.RankRegistered(t=0.5, rank=1, node=0, pid=11))
    state.apply(s.SessionEnded(t=60.0, returncode=0, summary="ok"))
    text = report.render(state, Outcome(0, "ok", "RUN"), "RUN")
    lines = [" ".join(line.split()) for line in text.splitlines()]  # the columns' padding aside
    assert "rank 1 node 0 pid 11 ran (no end) peak 400 B log RUN/rank-1.log" in lines
    assert ("default_pg (dddddddd) 4 ranks 4 collectives 208 B waited 2.7 s slowest rank 2 (last at 2 of 3)"
            in lines)


# ------------------------------------------------------------ many ranks (mirage_tui/state/rank_summary.py)


def test_many_ranks_the_grid_says_who_is_behind_and_who_waits_for_them():
    """256 ranks on 4 hosts stopped part-way through a step: two ranks hold everyone up."""
    import many_ranks_events as mre

    ranks = 256
    state = RunState()
    for e in mre.events(ranks):
        state.apply(e)
    summary = rank_summary.summarize(state)
    slow_tp, slow_dp = mre.slow_tp(ranks), mre.slow_dp(ranks)
    # the two that compute while others wait for them are behind; everyone else waits in a collective
    assert {r for r, word in summary.states.items() if word == "behind"} == {slow_tp, slow_dp}
    assert summary.counts["in collective"] == ranks - 2 and summary.counts["running"] == 0
    assert list(summary.counts) == list(rank_summary.CELL_STATES)
    # by host, then node: four hosts of eight nodes of eight ranks, in rank order
    assert list(summary.hosts) == ["host0", "host1", "host2", "host3"]
    assert [cells.node for cells in summary.hosts["host1"]] == list(range(8, 16))
    assert summary.order() == list(range(ranks))
    # the tree's words agree wherever the grid has no word of its own
    assert all(state.rank_state(r) == ("in collective" if w == "in collective" else "running")
               for r, w in summary.states.items())
    by_label = {}
    for c in summary.comms:
        by_label.setdefault(c.label.split(" (")[0], []).append(c)
    assert [c.seq for c in by_label["default_pg"]] == [0] and by_label["default_pg"][0].settled
    # slow_tp's node: 7 of 8 at all-reduce #7, the laggard named with the collective it last posted
    node_tp = next(c for c in by_label["mesh_tp"] if c.laggards)
    assert (node_tp.at, node_tp.size, node_tp.seq, node_tp.op, node_tp.completed) == (7, 8, 7, "ALLREDUCE", 6)
    assert [(lag.rank, lag.seq, lag.state) for lag in node_tp.laggards] == [(slow_tp, 6, "behind")]
    assert sum(1 for c in by_label["mesh_tp"] if c.settled) == 31
    # every data-parallel group waits at #4 for the held node's member; slow_dp's group for it too
    assert all(c.seq == 4 and c.completed == 3 and c.waiting_s > 0 for c in by_label["mesh_dp"])
    held = next(c for c in by_label["mesh_dp"] if any(lag.rank == slow_dp for lag in c.laggards))
    assert (held.at, held.size) == (30, 32)
    # its member on the held node waits in its tensor-parallel all-reduce: behind here, but held up itself
    assert [(lag.rank, lag.state) for lag in held.laggards] == [(8 + slow_dp % 8, "in collective"),
                                                               (slow_dp, "behind")]
    assert summary.behind_in[slow_dp] == [(held.comm, 3, 4)]


def test_many_ranks_memory_is_a_distribution_with_its_outliers():
    import many_ranks_events as mre

    ranks = 64
    state = RunState()
    assert rank_summary.memory_distribution(state) is None
    for e in mre.events(ranks):
        state.apply(e)
    dist = rank_summary.memory_distribution(state)
    assert dist is not None and dist.gpus == ranks and dist.total == mre.HBM and dist.near_full == 0
    assert dist.low < dist.p50 <= dist.p90 < dist.high and sum(dist.histogram) == ranks
    # the two odd ones out, the furthest from the median first; the first and last bins hold them alone
    assert [(o.rank, o.high) for o in dist.outliers] == [(mre.big_memory(ranks), True),
                                                        (mre.small_memory(ranks), False)]
    assert dist.histogram[0] == dist.histogram[-1] == 1
    assert dist.percentile_of(dist.low) == 0 and dist.percentile_of(dist.high + 1) == 100
    # identical replicas: no spread, no outlier
    same = RunState()
    for r in range(4):
        same.apply(s.MemoryUsage(t=1.0, rank=r, device=r, allocated=1 << 30, total=1 << 34))
    flat = rank_summary.memory_distribution(same)
    assert flat is not None and flat.outliers == () and flat.histogram[0] == 4 and flat.p50 == 1 << 30


def test_many_ranks_settled_states_win_and_point_to_point_never_lags():
    state = _started()
    comm = "c" * 16
    state.apply(s.CollectiveEnqueued(t=13.0, comm=comm, seq=1, rank=0, numel=4))
    summary = rank_summary.summarize(state, now=15.0)
    assert summary.states == {0: "in collective", 1: "behind"}
    (progress,) = summary.comms
    assert (progress.at, progress.size, progress.waiting_s) == (1, 2, 2.0) and not progress.settled
    # a send numbers its messages per pair: rank 1's seq 5 puts nobody behind
    state.apply(s.CollectiveEnqueued(t=14.0, comm=comm, seq=5, rank=1, op=s.CollOp.SEND, numel=4))
    assert rank_summary.summarize(state).states[0] == "in collective"
    state.apply(s.HangDetected(t=20.0, comm=comm, seq=1, joined=[0], missing=[1]))
    assert rank_summary.summarize(state).states == {0: "stuck", 1: "missing"}
    state.rank_killed(1)
    assert rank_summary.summarize(state).counts["failed"] == 1
