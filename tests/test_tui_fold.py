"""The run's fold (mirage_tui/runstate.py) on its own: rank and node states, and what each event changed.

No Textual and no processes: the screens draw these words, batch mode's session
and ``mirage status`` keep the same fold.
"""

from __future__ import annotations

from pathlib import Path

from emulator import schema as s
from mirage_tui import report
from mirage_tui.runstate import Changed, Outcome, RunState

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
