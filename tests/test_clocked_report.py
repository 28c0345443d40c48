"""What a clocked run reports (issue #16): the fold's prediction and timeline, the report, the trace files.

The fold is fed the hand-made run of ``clocked_events.py`` (four ranks, rank 2 1.4x slower), whose
figures are known exactly: in the steady state a step of the run is the slow rank's 14.6 ms
(forward 4.2 + backward 7.0 ms, the second all-reduce's 2 ms after it, the update's 1.4 ms), of which
compute 12.6 ms, communication 3.5 ms, exposed 2.0 ms (the first all-reduce hides behind its backward).
"""

from __future__ import annotations

import json

import clocked_events as ce
import pytest

from mirage_tui.config import rundir
from mirage_tui.config.topology import ExecMode, Topology
from mirage_tui.glyphs import human_seconds
from mirage_tui.reports import report
from mirage_tui.state.clocked import step_segments
from mirage_tui.state.runstate import Outcome, RunState
from wire import kineto_trace

MS = 1e-3


def _state(steps: int = 6, exec_mode: str = "clocked") -> RunState:
    state = RunState()
    for e in ce.events(steps, exec_mode):
        state.apply(e)
    return state


def test_the_prediction_is_the_slow_ranks_steady_step():
    p = _state().prediction()
    assert p is not None
    assert p.slowest_rank == ce.SLOW_RANK
    assert (p.first_measured, p.last_step, p.ranks) == (2, 6, ce.RANKS)  # step 1 is warm-up
    assert p.step_s == pytest.approx(14.6 * MS)
    assert p.compute_s == pytest.approx(12.6 * MS)
    assert p.comm_s == pytest.approx(3.5 * MS)
    assert p.exposed_comm_s == pytest.approx(2.0 * MS)
    assert (p.ops, p.bytes_only_ops) == (120 * 6 * ce.RANKS, 3 * 6 * ce.RANKS)


def test_a_fast_rank_keeps_the_slow_ranks_pace_and_waits():
    state = _state()
    fast, slow = state.rank_clock(0), state.rank_clock(ce.SLOW_RANK)
    assert fast.step_s == pytest.approx(slow.step_s)  # the all-reduces keep them in step
    assert fast.compute_s == pytest.approx(9.0 * MS)
    assert fast.exposed_comm_s == pytest.approx(3.5 * MS)  # its backward ends before the first all-reduce starts
    colls = list(state.clocked_colls[ce.COMM])
    waits = [seg for seg in step_segments(state.clocked_steps[0][3], colls) if seg.kind == "wait"]
    # 0.1 ms before the first all-reduce (its backward ends 8.0 ms in, the slow rank's is ready at 8.1),
    # 2.0 ms before the second (posted at 9.6 ms, started at 11.6 when the slow rank's backward ended)
    assert [round((w.end - w.start) / MS, 6) for w in waits] == [0.1, 2.0]
    slow_waits = [seg for seg in step_segments(state.clocked_steps[ce.SLOW_RANK][3], colls)
                  if seg.kind == "wait" and seg.end - seg.start > 1e-9]
    assert slow_waits == []  # everyone waits for it, it waits for no one


def test_the_timeline_holds_the_last_steps_every_rank_reported():
    timeline = _state().timeline(steps=3)
    assert (timeline.first_step, timeline.last_step) == (4, 6)
    assert sorted(timeline.lanes) == list(range(ce.RANKS))
    assert timeline.comms == (ce.COMM,)
    lane = timeline.lanes[ce.SLOW_RANK]
    assert [x.step for x in lane.steps] == [4, 5, 6]
    assert len(lane.colls) == 6  # two all-reduces a step
    assert timeline.t1 - timeline.t0 == pytest.approx(3 * 14.6 * MS, rel=0.03)  # the fast ranks start 0.4 ms early


def test_a_functional_run_has_no_clock():
    state = _state(exec_mode="functional")
    assert not state.clocked
    assert state.prediction() is None and state.timeline() is None


def test_report_json_and_text_carry_the_prediction(tmp_path):
    state = _state()
    run = rundir.create(str(tmp_path), sockets=False)
    outcome = Outcome(0, "all 1 node process(es) exited 0", run.path)
    topo = Topology(gpus_per_node=ce.RANKS, exec_mode=ExecMode.CLOCKED, command=("python", "x.py"))
    doc = report.to_json(state, topo, outcome, run)
    clocked = doc["clocked"]
    assert clocked["predicted_step_s"] == pytest.approx(14.6 * MS)
    assert clocked["slowest_rank"] == ce.SLOW_RANK
    assert set(clocked["ranks"]) == {"0", "1", "2", "3"}
    assert [x["step"] for x in clocked["ranks"]["2"]["per_step"]] == [1, 2, 3, 4, 5, 6]
    json.dumps(doc)  # a document, not objects
    line = report.clocked_line(state)
    assert line == ("clocked (mi350x): predicted step 14.6 ms (compute 12.6 ms, communication 3.5 ms, "
                    "exposed 2 ms) over steps 2-6, slowest rank 2")
    text = report.render(state, outcome, run.path)
    assert line in text and "means over every step after the first (warm-up)" in text
    functional = _state(exec_mode="functional")
    assert "clocked" not in report.to_json(functional, Topology(gpus_per_node=ce.RANKS, command=("x",)),
                                           outcome, run)


@pytest.mark.parametrize(("seconds", "text"), [(14.6e-3, "14.6 ms"), (2e-3, "2 ms"), (140e-6, "140 µs"),
                                               (5.43e-6, "5.43 µs"), (1.5, "1.5 s"), (0.0, "0 s"),
                                               (3e-9, "3 ns")])
def test_human_seconds(seconds, text):
    assert human_seconds(seconds) == text


def _rank_events(rank: int) -> list[tuple]:
    return [
        ("compute", "aten::mm", rank, 0, 0.0, 10e-6, {"flops": 2e9, "bytes": 1e6, "bound": "compute"}, 0.0),
        ("comm", "nccl:all_reduce", rank, 1 << 20, 5e-6, 12e-6, {"op": "all_reduce", "algo": "ring/LL",
                                                                 "group_size": 2}, 1e-6),
        ("compute", "aten::add", rank, 0, 12e-6, 13e-6, None, 2e-6),
        ("memcpy", "Memcpy DtoH", rank, 0, 13e-6, 14e-6, {"bytes": 8}, 2e-6),
    ]


def test_rank_traces_read_as_kineto_and_merge(tmp_path):
    for rank in (0, 1):
        kineto_trace.write_rank_trace(str(tmp_path / "traces" / f"rank-{rank}.json"), rank=rank, world_size=2,
                                      profile="mi350x", device_name="AMD Instinct MI350X",
                                      events=_rank_events(rank), steps=[(1, 0.0, 14e-6)], host_pid=4242)
    (tmp_path / "traces" / "rank-2.json").write_text('{"traceEvents": [')  # a rank killed mid-write
    head = (tmp_path / "traces" / "rank-1.json").read_text()[:200]
    assert head.startswith('{"distributedInfo": {"backend": "nccl", "rank": 1')  # where HTA looks for it
    one = json.loads((tmp_path / "traces" / "rank-1.json").read_text())
    kernels = [e for e in one["traceEvents"] if e["ph"] == "X" and e["pid"] != 4242]
    assert [e["name"] for e in kernels] == ["aten::mm", "ncclDevKernel_AllReduce_RING_LL", "aten::add",
                                             "Memcpy DtoH"]
    assert kernels[1]["ts"] == 5.0 and kernels[1]["dur"] == 7.0 and kernels[1]["args"]["Collective name"] == \
        "all_reduce"
    assert all(e["args"]["stream"] >= 0 and e["args"]["correlation"] > 0 for e in kernels)
    # the host's side, for HTA's per-iteration analyses: the step, and one launch per kernel, never after it
    host = [e for e in one["traceEvents"] if e["ph"] == "X" and e["pid"] == 4242]
    assert [(e["name"], e["ts"], e["dur"]) for e in host if e["cat"] == "user_annotation"] == \
        [("ProfilerStep#1", 0.0, 14.0)]
    launches = [e for e in host if e["cat"] == "cuda_runtime"]
    assert [e["name"] for e in launches] == ["hipLaunchKernel"] * 3 + ["hipMemcpyAsync"]
    assert [e["args"]["correlation"] for e in launches] == [e["args"]["correlation"] for e in kernels]
    assert [e["ts"] for e in launches] == [0.0, 1.0, 2.0, 2.0]
    merged_path = kineto_trace.merge_traces(str(tmp_path))
    merged = json.loads(open(merged_path).read())
    assert merged["mirage"]["ranks"] == [0, 1]
    assert [x["file"].rsplit("/", 1)[-1] for x in merged["mirage"]["skipped"]] == ["rank-2.json"]
    names = {(e["pid"], e["args"]["name"]) for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {(1, "rank 0 (GPU 0)"), (2, "rank 1 (GPU 1)")}
    # the kernels, and each rank's step on a host track; the launches stay in the rank files
    assert sum(e["ph"] == "X" for e in merged["traceEvents"]) == 10
    assert {(e["pid"], e["args"]["name"]) for e in merged["traceEvents"] if e.get("name") == "thread_name"
            and e["args"]["name"] == "host"} == {(1, "host"), (2, "host")}
    assert kineto_trace.merge_traces(str(tmp_path / "nothing")) is None
