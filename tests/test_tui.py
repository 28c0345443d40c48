"""The interactive console, driven by Textual's Pilot against real (short) runs and recorded ones."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from orphans import session_processes  # noqa: E402
from rich.console import Console  # noqa: E402
from textual.widgets import Button, DataTable, Input, Log, Select, Static, Switch, TextArea, Tree  # noqa: E402

from mirage_tui.app.app import MirageApp  # noqa: E402
from mirage_tui.app.confirm import ConfirmScreen  # noqa: E402
from mirage_tui.app.rank_grid import RankGrid  # noqa: E402
from mirage_tui.app.ranks_pane import RankTree  # noqa: E402
from mirage_tui.app.report import ReportScreen  # noqa: E402
from mirage_tui.app.run_screen import RunScreen  # noqa: E402
from mirage_tui.app.setup import SetupScreen  # noqa: E402
from mirage_tui.app.stacks_screen import StacksScreen  # noqa: E402
from mirage_tui.app.timeline_pane import TimelineBox, TimelinePane  # noqa: E402
from mirage_tui.config import launch_forms, topology_file  # noqa: E402
from mirage_tui.config.topology import ExecMode, OnHang, ProgramClock, Topology, UsageError, validate  # noqa: E402
from mirage_tui.state import replay  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "ml"
#: A recorded demo run (DDP MLP, 2 GPUs, 5 steps), committed so replays are deterministic.
RECORDED_RUN = REPO_ROOT / "tests" / "fixtures" / "runs" / "ddp-2gpu"
#: A recorded real run on 32 ranks (4 nodes x 8 GPUs): 32 live ranks take a minute to start on 2 cores.
RECORDED_32 = REPO_ROOT / "tests" / "fixtures" / "runs" / "allreduce-32gpu"
#: Two ranks (one per node, launched directly) reduce four 128 MiB tensors at once, BATCHES times: every
#: all_reduce takes many waves, so several collectives are in flight with their bytes half done.
BIG_ASYNC_ALLREDUCES = """
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl")
tensors = [torch.ones(32 * 2**20, device="cuda") for _ in range(4)]
for _ in range(int(os.environ.get("BATCHES", "200"))):
    for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
        work.wait()
print("big_async_ok", flush=True)
"""
SIZE = (140, 45)
DEADLINE_S = 60.0

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture(autouse=True)
def workload_env(monkeypatch, tmp_path):
    """Short runs, torchrun from this venv even when it is not activated, and a scratch working
    directory: the console saves the last topology it started under ./.mirage."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STEPS", "5")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _topology(tmp_path: Path, script: str, **kw) -> Topology:
    return Topology(
        gpus_per_node=2, log_dir=str(tmp_path),
        command=("torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / script)), **kw,
    )


def _tree_labels(screen: RunScreen) -> list[str]:
    tree = screen.query_one("#ranks", Tree)
    return [str(leaf.label) for node in tree.root.children for leaf in node.children]


def _completed_seqs(screen: RunScreen) -> list[int]:
    grid = screen.query_one("#collectives", DataTable)
    return [int(grid.get_row(key)[4]) for key in grid.rows]


def _final_state(screen: RunScreen) -> tuple:
    """What a replay must reproduce: tree states, completed seqs, the outcome."""
    return (_tree_labels(screen), sorted(_completed_seqs(screen)), screen.outcome.returncode, screen.outcome.summary)


async def _until(pilot, what, condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.1)


def _run_app(app: MirageApp, body) -> None:
    """Drive ``app`` with ``body(pilot)``; whatever happens, the run is torn down."""
    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await body(pilot)
            # let callbacks the body's last step queued (a sub_title's Header update) run before the app
            # tears its widgets down: Textual raises NoMatches for a Header update that lands after
            await pilot.pause()

    try:
        asyncio.run(main())
    finally:
        app.stop_session()


async def _replay_to_end(app: MirageApp, pilot) -> RunScreen:
    await _until(pilot, "the replay to end", lambda: app.outcome is not None)
    await _until_report(app, pilot)
    return app.run_screen


async def _until_report(app: MirageApp, pilot) -> None:
    await _until(pilot, "the report", lambda: isinstance(app.screen, ReportScreen) and app.screen.is_mounted)
    await pilot.pause(0.1)  # let it finish drawing (its header) before a test moves on or quits


def _shot(app: MirageApp, name: str, tmp_path: Path) -> Path:
    """A screenshot of the live screen (the docs' PNGs come from the deterministic snapshots instead)."""
    return Path(app.save_screenshot(filename=f"{name}.svg", path=str(tmp_path)))


# ---------------------------------------------------------------- live runs


def test_setup_enter_runs_the_demo_then_report_and_replay_match(tmp_path):
    topology = _topology(tmp_path, "ddp_mlp.py")
    last = tmp_path / "last-topology.toml"
    app = MirageApp(topology, setup=True, demo=topology, last_path=str(last))
    live: dict[str, object] = {}

    async def body(pilot) -> None:
        await _until(pilot, "the setup form", lambda: isinstance(app.screen, SetupScreen))
        await pilot.press("enter")  # Start has the focus: one key launches
        await _until(pilot, "the run screen", lambda: isinstance(app.screen, RunScreen))
        run = app.run_screen
        await _until(pilot, "ranks 0 and 1 in the tree",
                     lambda: {"rank 0", "rank 1"} <= {" ".join(label.split()[1:3]) for label in _tree_labels(run)})
        log = run.query_one("#output", Log)
        await _until(pilot, "rank 0's ddp_mlp_ok", lambda: any("ddp_mlp_ok" in line for line in log.lines))
        await _until(pilot, "the run to finish", lambda: app.outcome is not None)
        assert app.outcome.returncode == 0, app.outcome.summary
        # the report follows the run on its own
        await _until_report(app, pilot)
        report = app.screen.text
        assert "run ok: exit 0" in report and "findings\n  none" in report
        assert f"log {app.outcome.run_dir}/rank-1.log" in report and "node 0  exit 0" in report
        _shot(app, "report", tmp_path)
        await pilot.press("escape")  # back to the run
        assert app.screen is run
        assert max(_completed_seqs(run), default=0) > 0
        assert all(label.endswith("exited 0") for label in _tree_labels(run)), _tree_labels(run)
        assert str(run.query_one(RankTree).node_items[0].label) == "node 0 exit 0"
        # selecting rank 1 swaps the log to its output
        tree = run.query_one("#ranks", Tree)
        tree.select_node(run.query_one(RankTree).rank_items[1])
        await pilot.pause(0.2)
        assert log.border_title == "rank 1 output"
        assert not any("ddp_mlp_ok" in line for line in log.lines)  # only rank 0 prints it
        tree.select_node(run.query_one(RankTree).rank_items[0])
        await pilot.pause(0.2)
        assert any("ddp_mlp_ok" in line for line in log.lines)
        await pilot.press("t")
        assert app.theme == "mirage-high-contrast"  # the themes after the default, by file name
        await pilot.press("t", "t")
        assert app.theme == "mirage-dark"
        assert "ddp_mlp_ok" in _shot(app, "run", tmp_path).read_text()
        live["state"] = _final_state(run)
        await pilot.press("q")

    _run_app(app, body)
    assert app.return_code == 0
    # the form remembered what it started
    assert topology_file.load(str(last)).command == topology.command

    # the recording of that run, replayed, ends exactly where the run did
    recording = replay.load(app.outcome.run_dir)
    assert recording.skipped == 0
    replayed = MirageApp(recording=recording, speed=0)

    async def replay_body(pilot) -> None:
        screen = await _replay_to_end(replayed, pilot)
        assert _final_state(screen) == live["state"]

    _run_app(replayed, replay_body)


def test_hang_shows_missing_rank_in_alerts_and_report(tmp_path):
    app = MirageApp(_topology(tmp_path, "skip_allreduce.py", hang_timeout_s=2.0))

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        alerts = app.run_screen.query_one("#alerts-text", Static)
        await _until(pilot, "the hang report", lambda: "missing ranks: {1}" in str(alerts.content))
        await _until(pilot, "the run to finish", lambda: app.outcome is not None)
        assert app.outcome.returncode == 124
        await _until_report(app, pilot)
        assert "hang: collective #" in app.screen.text and "missing ranks {1}" in app.screen.text
        # one key from the alert: the stacks the session took at the hang, the missing rank's first
        await pilot.press("escape", "h")
        assert isinstance(app.screen, StacksScreen)
        first = app.screen.ranks[0]
        assert (first.rank, first.role) == (1, "missing") and {r.rank for r in app.screen.ranks} == {0, 1}
        shown = str(app.screen.query_one("#stacks-text", Static).content)
        assert 'skip_allreduce.py", line 16 in <module>' in shown  # rank 1 sleeps instead of reducing
        await pilot.press("down")  # rank 0: waiting in the all_reduce rank 1 never joined
        assert "in all_reduce" in str(app.screen.query_one("#stacks-text", Static).content)
        await pilot.press("escape")
        assert app.screen is app.run_screen

    _run_app(app, body)


def test_a_rank_that_raised_is_failed_in_the_tree(tmp_path):
    app = MirageApp(_topology(tmp_path, "ddp_raise.py"))  # rank 1 raises at step 5; torchrun stops rank 0

    async def body(pilot) -> None:
        await _until(pilot, "the run to finish", lambda: app.outcome is not None)
        await _until_report(app, pilot)
        run = app.run_screen
        assert app.outcome.returncode == 1 and "rank 1 raised" in app.outcome.summary
        assert _tree_labels(run)[1] == "● rank 1 gpu 1 failed", _tree_labels(run)
        assert str(run.query_one(RankTree).node_items[0].label) == "node 0 exit 1"

    _run_app(app, body)


def test_quit_while_running_tears_the_run_down(tmp_path):
    app = MirageApp(_topology(tmp_path, "skip_allreduce.py"))  # rank 1 sleeps for 2 minutes

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        await _until(pilot, "ranks to register", lambda: len(_tree_labels(app.run_screen)) == 2)
        # a rank registers while torch still imports: its stack is in the script once it said it skips
        await _until(pilot, "rank 1 to skip", lambda: "skipping" in app.run_screen.state.last_output.get(1, ("",))[0])
        started = time.monotonic()
        await pilot.press("s")  # every live rank's stacks, over the run screen
        await _until(pilot, "the stack dump", lambda: isinstance(app.screen, StacksScreen))
        assert [r.rank for r in app.screen.ranks] == [0, 1]
        assert "skip_allreduce.py" in app.screen.ranks[1].stacks
        await pilot.press("escape")
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmScreen)  # the run is live: quitting asks first
        await pilot.press("n")
        assert app.screen is app.run_screen and app.outcome is None
        await pilot.press("q", "y")
        await _until(pilot, "the run to stop", lambda: app.outcome is not None)
        assert time.monotonic() - started < 30
        await pilot.pause(0.2)

    _run_app(app, body)
    assert app.return_code == 130  # stopped, as a Ctrl-C in batch mode
    assert app.outcome.returncode == 130


def test_a_clocked_run_from_the_form_shows_its_timeline(tmp_path):
    """Exec mode "clocked" in the setup form: the run screen grows the timeline, c hides and shows it."""
    topology = _topology(tmp_path, "ddp_mlp.py", env=(("STEPS", "6"),))
    app = MirageApp(topology, setup=True, demo=topology, last_path=str(tmp_path / "last.toml"))

    async def body(pilot) -> None:
        await _until(pilot, "the setup form", lambda: isinstance(app.screen, SetupScreen))
        app.screen.query_one("#exec-mode", Select).value = ExecMode.CLOCKED.value
        await pilot.pause(0.1)
        assert app.screen.topology.exec_mode is ExecMode.CLOCKED
        await pilot.click("#start")
        await _until(pilot, "the run to finish", lambda: app.outcome is not None)
        assert app.outcome.returncode == 0, app.outcome.summary
        await _until_report(app, pilot)
        assert "clocked (mi350x): predicted step " in app.screen.text
        await pilot.press("escape")
        run = app.run_screen
        box, pane = run.query_one(TimelineBox), run.query_one(TimelinePane)
        assert box.display
        text = str(pane.render())
        assert "predicted step" in text and "steps 4-6" in text and "r0 " in text and "r1 " in text
        await pilot.press("c")
        assert not box.display
        await pilot.press("c")
        assert box.display
        await pilot.press("q")

    _run_app(app, body)
    assert app.return_code == 0


def test_stop_and_restart_keys_relaunch_the_same_topology(tmp_path):
    topology = _topology(tmp_path, "skip_allreduce.py", on_hang=OnHang.WAIT)  # rank 1 sleeps for 2 minutes
    app = MirageApp(topology)

    async def registered(pilot, what: str) -> RunScreen:
        await _until(pilot, what, lambda: app.run_screen is not None and app.run_screen.is_mounted
                     and len(_tree_labels(app.run_screen)) == 2)
        return app.run_screen

    first = second = third = None

    async def body(pilot) -> None:
        nonlocal first, second, third
        await _until(pilot, "the run screen", lambda: app.run_screen is not None and app.run_screen.is_mounted)
        # before any rank registered, the node says so (torch takes seconds to import)
        assert str(app.run_screen.query_one("#ranks", Tree).root.children[0].label) == "node 0 starting"
        first = await registered(pilot, "the first run's ranks")
        assert str(first.query_one(RankTree).node_items[0].label) == "node 0"
        await pilot.press("R")
        assert isinstance(app.screen, ConfirmScreen)  # live: restarting asks first
        await pilot.press("y")
        await _until(pilot, "the second run", lambda: app.run_screen is not first)
        second = await registered(pilot, "the second run's ranks")
        # the first run was stopped cleanly before the second started: nothing of it is left
        assert first.outcome.returncode == 130
        assert not session_processes({first.feed.session.run.session})
        assert second.feed.session.run.path != first.feed.session.run.path
        assert second.feed.topology == topology
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await _until_report(app, pilot)
        assert second.outcome.returncode == 130 and "stopped from the console" in app.screen.text
        await pilot.press("R")  # from the report: the same topology once more
        third = await registered(pilot, "the third run's ranks")
        assert third is not second and isinstance(app.screen, RunScreen)
        await pilot.press("x", "y")
        await _until_report(app, pilot)
        # N: back to the form, filled with this topology, to change it and start another run
        await pilot.press("N")
        assert isinstance(app.screen, SetupScreen) and app.run_screen is None
        assert app.screen.topology == topology
        await pilot.press("q")  # nothing runs: no question

    _run_app(app, body)
    assert app.return_code == 0
    assert not session_processes({run.feed.session.run.session for run in (first, second, third)})


def test_a_progress_bar_for_every_collective_in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHES", "1000")  # more than the test needs: it stops the run itself
    app = MirageApp(Topology(num_nodes=2, log_dir=str(tmp_path), command=(sys.executable, "-c", BIG_ASYNC_ALLREDUCES)))

    def bars() -> list[str]:
        """The pane's collective lines (after the throughput line) while several are partly done."""
        lines = str(app.run_screen.query_one("#inflight", Static).content).splitlines()[1:]
        return lines if len(lines) >= 2 and any(" 0%" not in line for line in lines) else []

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        await _until(pilot, "several collectives in flight, bytes done", bars)
        seen = bars()
        assert all("allreduce" in line and "of 128.0 MiB" in line and "░" in line for line in seen), seen
        await _until(pilot, "a completed collective's throughput",
                     lambda: "throughput" in str(app.run_screen.query_one("#inflight", Static).content)
                     and " 0 B/s" not in str(app.run_screen.query_one("#inflight", Static).content))
        grid = app.run_screen.query_one("#collectives", DataTable)
        assert any(row[6] == "128.0 MiB" for row in map(grid.get_row, grid.rows))  # the size column
        await pilot.press("x", "y")
        await _until(pilot, "the run to stop", lambda: app.outcome is not None)
        assert app.outcome.returncode == 130

    _run_app(app, body)


def test_kill_rank_from_the_console_shows_the_dead_peer(tmp_path):
    # launched directly, one process per node: no torchrun agent tears rank 0 down before the daemon
    # notices its peer is gone. Rank 1 sleeps; rank 0 waits for it in an all_reduce.
    app = MirageApp(Topology(num_nodes=2, log_dir=str(tmp_path),
                             command=(sys.executable, str(FIXTURES / "skip_allreduce.py"))))

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        run = app.run_screen
        await _until(pilot, "rank 0 in its all_reduce", lambda: "in collective" in " ".join(_tree_labels(run)))
        run.query_one("#ranks", Tree).select_node(run.query_one(RankTree).rank_items[1])
        await pilot.pause(0.1)
        await pilot.press("k")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await _until(pilot, "the run to end", lambda: app.outcome is not None)
        assert app.outcome.returncode != 0
        await _until_report(app, pilot)
        assert "dead peer: communicator" in app.screen.text, app.screen.text
        assert "killed rank 1 (pid" in str(run.query_one("#alerts-text", Static).content)
        assert _tree_labels(run)[1].endswith("rank 1 gpu 0 failed")  # on node 1's only GPU

    _run_app(app, body)


# ---------------------------------------------------------------- replay of the recorded fixture


def test_replay_skips_and_counts_garbage_lines(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED_RUN, run_dir)
    clean = replay.load(str(run_dir))
    lines = (run_dir / "events.jsonl").read_bytes().splitlines(keepends=True)
    # a line cut short in the middle, a garbage one, and a last line cut short by a dying writer
    lines.insert(3, lines[3][: len(lines[3]) // 2] + b"\n")
    lines.insert(10, b"\x00\xffnot json at all\n")
    lines.append(b'{"v":1,"type":"output","t":1')
    (run_dir / "events.jsonl").write_bytes(b"".join(lines))
    damaged = replay.load(str(run_dir))
    assert damaged.skipped == 3 and damaged.events == clean.events

    states = []
    for recording in (clean, damaged):
        app = MirageApp(recording=recording, speed=0)

        async def body(pilot, app=app) -> None:
            screen = await _replay_to_end(app, pilot)
            states.append(_final_state(screen))
            if recording is damaged:
                alerts = str(screen.query_one("#alerts-text", Static).content)
                assert "3 unreadable line(s) of events.jsonl skipped" in alerts
                assert "3 unreadable line(s)" in app.screen.text

        _run_app(app, body)
    assert states[0] == states[1]
    assert all(label.endswith("exited 0") for label in states[0][0])


def test_replay_pause_step_and_speed_keys(tmp_path):
    recording = replay.load(str(RECORDED_RUN))
    app = MirageApp(recording=recording, speed=1.0)

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        player = app.run_screen.feed.player
        await pilot.press("space")
        assert player.paused
        await pilot.pause(0.3)
        at = player.position
        await pilot.press("full_stop")
        await _until(pilot, "one step", lambda: player.position == at + 1)
        await pilot.press("n")
        await _until(pilot, "another step", lambda: player.position == at + 2)
        await pilot.pause(0.3)
        assert player.position == at + 2  # paused: nothing more plays
        await pilot.press("plus", "plus")
        assert player.speed == 4.0
        await pilot.press("minus")
        assert player.speed == 2.0
        bar = str(app.run_screen.query_one("#replay-bar", Static).content)
        assert "paused at 2x" in bar and f"event {at + 2} of {player.total}" in bar
        # R plays it again from the start, on a fresh screen; the old one's player is stopped
        old = app.run_screen
        await pilot.press("R")
        await _until(pilot, "the replay to start over", lambda: app.run_screen is not old and app.run_screen.is_mounted)
        assert old.feed.player.position == at + 2 and not old.feed.running
        player = app.run_screen.feed.player
        assert not player.paused and player.position < at + 2
        player.speed = 0  # the rest as fast as possible
        await _replay_to_end(app, pilot)
        assert old.outcome is None  # its last messages went nowhere: no report of the abandoned replay

    _run_app(app, body)


def test_flight_recorder_dump_of_a_replay_holds_the_events_played(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED_RUN, run_dir)
    app = MirageApp(recording=replay.load(str(run_dir)), speed=0)

    async def body(pilot) -> None:
        screen = await _replay_to_end(app, pilot)
        await pilot.press("escape", "d")
        alerts = screen.query_one("#alerts-text", Static)
        await _until(pilot, "the dump", lambda: "Flight Recorder dumps:" in str(alerts.content))

    _run_app(app, body)
    assert sorted(p.name for p in (run_dir / "flight-recorder").iterdir()) == ["nccl_trace_rank_0", "nccl_trace_rank_1"]


def test_32_ranks_are_navigable_in_the_tree_and_the_grid():
    app = MirageApp(recording=replay.load(str(RECORDED_32)), speed=0)

    async def body(pilot) -> None:
        screen = await _replay_to_end(app, pilot)
        await pilot.press("escape")
        assert screen.query_one("#grid-pane").display and not screen.query_one("#ranks").display
        await pilot.press("g")  # past 16 ranks the views for many ranks are up: back to the tree
        tree = screen.query_one("#ranks", Tree)
        assert tree.display and not screen.query_one("#grid-pane").display
        assert [str(node.label) for node in tree.root.children] == [f"node {n} exit 0" for n in range(4)]
        assert [leaf.data for node in tree.root.children for leaf in node.children] == \
            [("rank", r) for r in range(32)]  # sorted, though they registered in any order
        assert all(label.endswith("exited 0") for label in _tree_labels(screen))
        # keys alone reach the last rank: shift+down from node to node, then down to its last rank
        tree.focus()
        tree.move_cursor(tree.root.children[0])
        await pilot.press("shift+down", "shift+down", "shift+down")
        assert tree.cursor_node.data == ("node", 3)
        await pilot.press(*["down"] * 8, "enter")
        assert tree.cursor_node.data == ("rank", 31)
        assert screen.query_one("#output", Log).border_title == "rank 31 output"
        assert "[rank 31] allreduce_loop_ok" in screen.query_one("#output", Log).lines
        assert tree.scroll_y > 0  # the tree scrolled to keep the cursor in view
        # the grid has a row per rank; enter on one picks that rank in the tree
        grid = screen.query_one("#collectives", DataTable)
        assert grid.row_count == 32 and {int(grid.get_row(k)[4]) for k in grid.rows} == {10}
        grid.focus()
        await pilot.press("ctrl+home", *["down"] * 5, "enter")
        assert tree.cursor_node.data == ("rank", 5) and screen.query_one("#output", Log).border_title == "rank 5 output"
        # and the mouse: a click on a rank's line in the tree (under the border: node 0, rank 0, rank 1, ...)
        tree.scroll_home(animate=False)
        await pilot.pause(0.1)
        await pilot.click("#ranks", offset=(12, 3))
        assert screen.query_one("#output", Log).border_title == "rank 1 output"

    _run_app(app, body)


def test_32_ranks_in_the_grid_keys_and_mouse_pick_a_rank():
    """The views for many ranks on the recorded 32-rank run: cells by node, arrows, Enter, a click, g back."""
    app = MirageApp(recording=replay.load(str(RECORDED_32)), speed=0)

    async def body(pilot) -> None:
        screen = await _replay_to_end(app, pilot)
        await pilot.press("escape")
        grid = screen.query_one("#rank-grid", RankGrid)
        output = screen.query_one("#output", Log)
        assert grid.summary.order() == list(range(32)) and grid.summary.counts["exited 0"] == 32
        assert "every rank done, at #10" in str(screen.query_one("#comm-progress", Static).content)
        assert "32 GPUs of 288.0 GiB allocated" in str(screen.query_one("#memory-dist", Static).content)
        grid.focus()
        # a node a line: right moves along rank order, down to the same column of the next node
        await pilot.press("right", "right", "down", "down", "enter")
        assert grid.cursor == 18 and output.border_title == "rank 18 output"
        await pilot.press("end", "enter")
        assert grid.cursor == 31 and "[rank 31] allreduce_loop_ok" in output.lines
        # the mouse: the cell under the pointer (a line of legend, then node 0's cells two columns apart)
        x, y = next(at for at, rank in grid._cells.items() if rank == 5)[::-1]
        await pilot.click("#rank-grid", offset=(x, y))
        assert grid.cursor == 5 and output.border_title == "rank 5 output"
        # nobody is behind in a run that ended well; g: the tree, on the rank picked in the grid
        await pilot.press("b", "g")
        tree = screen.query_one("#ranks", Tree)
        assert tree.display and tree.cursor_node.data == ("rank", 5) and tree.has_focus

    _run_app(app, body)


def test_help_screen_and_palette_list_the_keys():
    app = MirageApp(recording=replay.load(str(RECORDED_RUN)), speed=0)

    async def body(pilot) -> None:
        screen = await _replay_to_end(app, pilot)
        await pilot.press("escape", "question_mark")
        from mirage_tui.app.help_screen import HelpScreen

        assert isinstance(app.screen, HelpScreen)
        text = app.screen.query_one("#help-text", Static)
        console = Console(width=120, file=io.StringIO(), record=True)
        console.print(text.content)
        rendered = console.export_text()
        for key, name in (("k", "Kill rank"), ("s", "Stacks"), ("d", "FR dump"), ("h", "Hang stacks"),
                          ("x", "Stop"), ("R", "Restart"), ("ctrl+s", "Start"), ("q", "Quit"), ("t", "Theme")):
            assert any(line.split()[:len(name.split()) + 1] == [key, *name.split()]
                       for line in rendered.splitlines()), (key, name)
        await pilot.press("question_mark")
        assert app.screen is screen
        # the palette offers what works here and now: a finished replay can be restarted, not killed
        titles = [c.title for c in app.get_system_commands(screen)]
        assert "Restart (R)" in titles and "FR dump (d)" in titles and "Quit (q)" in titles
        assert "Quit" not in titles and "Theme" not in titles  # Textual's own, which ours replace
        assert not any(t.startswith(("Kill rank", "Stop", "Hang stacks", "Pause")) for t in titles)
        # and picking one in the palette does what its key does
        await pilot.press("ctrl+p", *"restart")
        await pilot.pause(0.5)  # the palette gathers its commands in the background
        await pilot.press("down", "enter")
        await _until(pilot, "the replay to start again", lambda: app.run_screen is not screen)
        await _replay_to_end(app, pilot)

    _run_app(app, body)


def test_player_honours_recorded_gaps():
    events = replay.load(str(RECORDED_RUN)).events[:3]
    t0 = events[0].t
    # three events 0.2 s apart, replayed at 2x: about 0.2 s in all
    spaced = tuple(type(e)(**{**e.__dict__, "t": t0 + 0.2 * i}) for i, e in enumerate(events))
    player = replay.Player(replay.Recording("x", spaced, 0), speed=2.0)
    started = time.monotonic()
    assert list(player) == list(spaced)
    assert 0.15 < time.monotonic() - started < 1.0


# ---------------------------------------------------------------- setup form


def test_setup_keeps_the_program_clock_while_clocked(tmp_path):
    """--program-clock has no field in the form: it stays the command line's while the exec mode is clocked."""
    demo = _topology(tmp_path, "ddp_mlp.py", exec_mode=ExecMode.CLOCKED, program_clock=ProgramClock.EMULATED)
    app = MirageApp(demo, setup=True, demo=demo, last_path=str(tmp_path / "last.toml"))

    async def body(pilot) -> None:
        await _until(pilot, "the setup form", lambda: isinstance(app.screen, SetupScreen))
        form = app.screen
        assert form.topology is not None and form.topology.program_clock is ProgramClock.EMULATED
        form.query_one("#exec-mode", Select).value = ExecMode.FUNCTIONAL.value
        await pilot.pause(0.1)  # functional keeps no emulated clock: the program reads wall time, and may start
        assert form.topology is not None and form.topology.program_clock is ProgramClock.WALL
        form.query_one("#exec-mode", Select).value = ExecMode.CLOCKED.value
        await pilot.pause(0.1)
        assert form.topology is not None and form.topology.program_clock is ProgramClock.EMULATED

    _run_app(app, body)


def test_setup_validates_with_the_cli_rules_and_loads_toml(tmp_path):
    demo = _topology(tmp_path, "ddp_mlp.py")
    saved = tmp_path / "saved.toml"
    topology_file.save(Topology(num_nodes=2, gpus_per_node=1, env=(("A", "1"),), command=("python", "x.py")),
                       str(saved))
    app = MirageApp(demo, setup=True, demo=demo, last_path=str(tmp_path / "last.toml"))

    async def body(pilot) -> None:
        await _until(pilot, "the setup form", lambda: isinstance(app.screen, SetupScreen))
        form = app.screen
        error = form.query_one("#setup-error", Static)
        start = form.query_one("#start", Button)
        assert not start.disabled and "ready" in str(error.content)
        form.query_one("#gpus", Input).value = "65"
        await pilot.pause(0.1)
        with pytest.raises(UsageError) as cli_error:  # the very message the command line gives
            validate(Topology(gpus_per_node=65, command=("x",)))
        assert str(cli_error.value) in str(error.content) and start.disabled
        form.query_one("#gpus", Input).value = "4"
        await pilot.pause(0.1)
        # the generated torchrun command follows the GPUs per node
        assert "--nproc_per_node=4" in form.query_one("#command", Input).value and not start.disabled
        form.query_one("#hbm", Input).value = "8 potatoes"
        await pilot.pause(0.1)
        assert "--hbm expects a size such as 8GiB" in str(error.content) and start.disabled
        form.query_one("#hbm", Input).value = "8GiB"
        await pilot.pause(0.1)
        assert form.topology is not None and form.topology.hbm_bytes == 8 * 2**30
        form.query_one("#env", TextArea).text = "1BAD=x"
        await pilot.pause(0.1)
        assert "not a valid environment variable name" in str(error.content)
        form.query_one("#env", TextArea).text = ""
        # the command line's checks of the program and of flags that contradict each other
        command = form.query_one("#command", Input)
        generated = command.value
        command.value = "no-such-program-here x.py"
        await pilot.pause(0.1)
        assert "command not found: no-such-program-here" in str(error.content) and start.disabled
        command.value = generated
        form.query_one("#nodes", Input).value = "2"
        form.query_one("#in-process", Switch).value = True
        await pilot.pause(0.1)
        assert "--in-process runs without the daemon, so it cannot join --num-nodes 2" in str(error.content)
        form.query_one("#in-process", Switch).value = False
        form.query_one("#nodes", Input).value = "1"
        await pilot.pause(0.1)
        assert not start.disabled, str(error.content)
        # the run flags: blank is the flag not given; a value is checked as the command line checks it
        form.query_one("#debug-rank", Input).value = "4"
        await pilot.pause(0.1)
        assert "--debug-rank must be a rank of the run, 0 to 3 (1 node(s) x 4 GPU(s)), got 4" in str(error.content)
        form.query_one("#debug-rank", Input).value = "3"
        form.query_one("#workdir", Input).value = str(FIXTURES)
        form.query_one("#clear-env", Switch).value = True
        await pilot.pause(0.1)
        assert form.topology is not None, str(error.content)
        assert (form.topology.debug_rank, form.topology.workdir, form.topology.clear_env) == (3, str(FIXTURES), True)
        form.query_one("#nproc", Input).value = "2"
        await pilot.pause(0.1)  # the ranks mirage would start are then the ones to count
        assert "--debug-rank must be a rank of the run, 0 to 1 (1 node(s) x --nproc-per-node 2)" in str(error.content)
        form.query_one("#debug-rank", Input).value = ""
        await pilot.pause(0.1)
        assert "--nproc-per-node makes mirage start the ranks itself" in str(error.content)  # torchrun's command
        form.query_one("#nproc", Input).value = ""
        form.query_one("#workdir", Input).value = ""
        await pilot.pause(0.1)
        assert form.topology is not None and (form.topology.nproc_per_node, form.topology.debug_rank) == (None, None)
        # file completion in the command field: the right arrow takes the suggestion
        command.focus()
        command.value = f"python {FIXTURES}/ddp_m"
        await pilot.pause(0.2)
        await pilot.press("right")
        assert command.value == f"python {FIXTURES}/ddp_mlp.py"
        form.query_one("#load-path", Input).value = str(saved)
        await pilot.click("#load")
        await pilot.pause(0.1)
        assert form.query_one("#nodes", Input).value == "2" and form.query_one("#command", Input).value == "python x.py"
        assert form.topology is not None and form.topology.env == (("A", "1"),)

    _run_app(app, body)
    assert app.run_screen is None  # nothing was started


# ---------------------------------------------------------------- pieces without a run


def test_launch_forms_round_trip():
    script = ("train.py", "--lr", "0.1")
    single = launch_forms.build(launch_forms.TORCHRUN, ("python", *script), 1, 4)
    assert single[1:] == ("--standalone", "--nproc_per_node=4", *script)
    assert launch_forms.launch_form(single) == launch_forms.TORCHRUN and launch_forms.program(single) == list(script)
    multi = launch_forms.build(launch_forms.TORCHRUN, single, 2, 4)
    assert multi[:2] == ("sh", "-c") and "--node_rank=$RANK" in multi[2]
    assert launch_forms.launch_form(multi) == launch_forms.TORCHRUN and launch_forms.program(multi) == list(script)
    direct = launch_forms.build(launch_forms.DIRECT, multi, 2, 4)
    assert direct[1:] == script and launch_forms.launch_form(direct) == launch_forms.DIRECT
    assert launch_forms.program(("torchrun", "--nproc-per-node", "8", "t.py")) == ["t.py"]


def test_topology_file_round_trip_and_errors(tmp_path):
    t = Topology(profile="mi300x", num_nodes=2, gpus_per_node=4, env=(("K", 'a "b"'),), hang_timeout_s=5,
                 in_process=True, hbm_bytes=8 * 2**30, command=("python", "it's.py"))
    path = tmp_path / "t.toml"
    topology_file.save(t, str(path))
    assert topology_file.load(str(path)) == t
    path.write_text("num_nodes = 'two'\n")
    with pytest.raises(UsageError, match="num_nodes must be a int"):
        topology_file.load(str(path))
    path.write_text("gpus = 2\n")
    with pytest.raises(UsageError, match="unknown key 'gpus'"):
        topology_file.load(str(path))
    clocked = dataclasses.replace(t, in_process=False, exec_mode=ExecMode.CLOCKED)
    topology_file.save(clocked, str(path))
    assert topology_file.load(str(path)) == clocked
    path.write_text("exec_mode = 'timed'\n")
    with pytest.raises(UsageError, match="exec_mode must be one of functional, clocked"):
        topology_file.load(str(path))
    program = dataclasses.replace(clocked, program_clock=ProgramClock.EMULATED)
    topology_file.save(program, str(path))
    assert 'program_clock = "emulated"' in path.read_text() and topology_file.load(str(path)) == program
    path.write_text("program_clock = 'gpu'\n")
    with pytest.raises(UsageError, match="program_clock must be one of wall, emulated"):
        topology_file.load(str(path))
    # the run flags of the Setup form's last rows; a flag not given has no line and keeps the base's value
    flags = dataclasses.replace(clocked, nproc_per_node=3, workdir="sub dir/\"x\"", clear_env=True, debug_rank=5)
    topology_file.save(flags, str(path))
    assert topology_file.load(str(path)) == flags
    topology_file.save(t, str(path))
    assert "nproc_per_node" not in path.read_text() and "debug_rank" not in path.read_text()
    assert topology_file.load(str(path), base=flags) == dataclasses.replace(t, nproc_per_node=3, workdir=flags.workdir,
                                                                              debug_rank=5)
    for bad, why in (("debug_rank = 'one'", "debug_rank must be a int"), ("clear_env = 1", "clear_env must be a bool"),
                     ("workdir = 3", "workdir must be a str"), ("nproc_per_node = true", "nproc_per_node must be a int")):
        path.write_text(bad + "\n")
        with pytest.raises(UsageError, match=why):
            topology_file.load(str(path))


def test_replay_of_a_directory_without_events_is_a_usage_error(tmp_path, capsys):
    from mirage_tui.cli import tui_main

    assert tui_main(["--replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no events.jsonl" in err[0]
    assert tui_main(["--theme", "pink"]) == 2
    assert "--theme must be one of dark, high-contrast, light" in capsys.readouterr().err


def test_batch_and_cli_do_not_import_textual():
    code = "import sys, mirage_tui.commands.batch, mirage_tui.cli, mirage_tui.state.replay; print('textual' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


def test_demo_command_points_at_the_bundled_fixture():
    from mirage_tui.cli import _demo_command

    cmd = _demo_command(2)
    assert cmd[1:3] == ("--standalone", "--nproc_per_node=2") and Path(cmd[-1]).is_file()


def test_themes_load_with_rank_state_variables():
    from mirage_tui.app.themes import RANK_STATE_VARIABLES, THEMES_DIR, load_theme, resolve

    names = set()
    for path in sorted(THEMES_DIR.glob("*.toml")):
        theme = load_theme(path)
        names.add(theme.name)
        assert set(RANK_STATE_VARIABLES.values()) <= set(theme.variables)
    assert {"mirage-dark", "mirage-light", "mirage-high-contrast"} <= names
    assert resolve("light") == resolve("mirage-light") == "mirage-light" and resolve("pink") is None
    # the top-level themes/ the architecture names is the package's folder
    assert (REPO_ROOT / "themes").resolve() == THEMES_DIR


def test_no_color_is_honoured(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = MirageApp(recording=replay.load(str(RECORDED_RUN)), speed=0)
    assert app.no_color


def test_output_filter_stderr_toggle_and_timestamps():
    app = MirageApp(recording=replay.load(str(RECORDED_RUN)), speed=0)

    async def body(pilot) -> None:
        screen = await _replay_to_end(app, pilot)
        await pilot.press("escape")  # from the report back to the run
        log = screen.query_one("#output", Log)
        everything = list(log.lines)
        # rank 1 registers and prints before rank 0 registers, in one drain: none of it lands in rank 0's pane
        assert everything[0].startswith("[rank 0]") and not any("[rank 1]" in line for line in everything)
        assert any("Warning: Time stats" in line for line in everything)  # rank 0's stderr
        await pilot.press("slash", *"steps")  # "t" and "s" are keys too, but not while typing here
        assert [line for line in log.lines if line] == [line for line in everything if "steps" in line] != []
        assert "lines with 'steps'" in log.border_title
        await pilot.press("enter")
        assert log.has_focus
        await pilot.press("slash", "escape")  # esc in the field clears the filter
        assert list(log.lines) == everything
        await pilot.press("e")
        assert not any("Warning: Time stats" in line for line in log.lines) and "stdout only" in log.border_title
        await pilot.press("e", "T")
        assert all(line[2] == ":" and line[8] == "." for line in log.lines if line)
        assert app.theme == "mirage-dark"  # the "t" typed into the filter field never reached the app
        # compare two ranks: pin rank 0, pick rank 1
        await pilot.press("T", "v")
        pinned = screen.query_one("#pinned", Log)
        assert pinned.display and pinned.border_title == "rank 0 output (pinned)"
        screen.query_one("#ranks", Tree).select_node(screen.query_one(RankTree).rank_items[1])
        await pilot.pause(0.1)
        assert log.border_title == "rank 1 output" and not any("ddp_mlp_ok" in line for line in log.lines)
        assert any("ddp_mlp_ok" in line for line in pinned.lines)
        await pilot.press("v")
        assert not pinned.display

    _run_app(app, body)


def test_gpu_pane_shows_memory_reports_with_history():
    from wire import schema as s

    if not hasattr(s, "MemoryUsage"):
        pytest.skip("this schema has no memory_usage event")
    gib = 2**30
    base = replay.load(str(RECORDED_RUN)).events
    t0 = base[0].t
    reports = tuple(s.MemoryUsage(t=t0 + i / 100, rank=r, node=0, device=r, allocated=(i + 1) * gib,
                                  reserved=(i + 2) * gib, peak=(i + 1) * gib, total=288 * gib)
                    for i in range(3) for r in (0, 1))
    recording = replay.Recording("synthetic", (base[0], *reports), 0)
    app = MirageApp(recording=recording, speed=0)

    async def body(pilot) -> None:
        screen = await _replay_to_end(app, pilot)
        text = str(screen.query_one("#gpu-memory", Static).content)
        lines = text.splitlines()
        assert [line.split()[0] for line in lines] == ["r0", "r1"]
        assert "3.0 GiB/288.0 GiB" in lines[0]
        assert lines[0].endswith(" ▃▅█")  # one history mark per report: 1, 2, 3 GiB

    _run_app(app, body)


def test_traffic_shows_every_collective_in_flight_and_throughput():
    from mirage_tui.state.traffic import Traffic
    from wire import schema as s

    mib = 2**20
    traffic = Traffic()
    for e in (s.CollectiveCompleted(t=100.2, comm="c" * 16, seq=1, total_bytes=4 * mib),
              s.CollectiveCompleted(t=102.5, comm="c" * 16, seq=2, total_bytes=8 * mib),
              s.CollectiveStarted(t=102.6, comm="c" * 16, seq=3, total_bytes=64 * mib),
              s.CollectiveStarted(t=102.6, comm="d" * 16, seq=1, op=s.CollOp.ALLGATHER, total_bytes=32 * mib),
              s.CollectiveProgress(t=102.7, comm="c" * 16, seq=3, done_bytes=16 * mib, total_bytes=64 * mib),
              s.CollectiveProgress(t=102.8, comm="d" * 16, seq=1, done_bytes=24 * mib, total_bytes=32 * mib),
              s.OutputLine(t=102.8, rank=0, text="not traffic")):
        traffic.apply(e)
    # one character per second (the idle second 101 included), the last second's rate
    assert traffic.throughput() == "throughput ▄ █ 8.0 MiB/s"
    # a bar per collective in flight, in the order they started, with bytes done and age
    assert traffic.lines(now=103.6) == [
        "allreduce      #3     cccccccc █████░░░░░░░░░░░░░░░  25% 16.0 MiB of 64.0 MiB, 1.0 s",
        "allgather      #1     dddddddd ███████████████░░░░░  75% 24.0 MiB of 32.0 MiB, 1.0 s",
    ]
    traffic.apply(s.CommFailed(t=104, comm="d" * 16, code="ncclRemoteError", message="peer gone"))
    traffic.apply(s.CollectiveCompleted(t=104.5, comm="c" * 16, seq=3, total_bytes=64 * mib))
    assert traffic.lines(now=105) == []
    assert traffic.throughput() == "throughput   ▁ █ 64.0 MiB/s"  # seconds 100 to 104, scaled to the top one
    # a live run's idle seconds count as zero once the clock passes them
    assert traffic.advance(now=106.2) and traffic.throughput() == "throughput   ▁ █  0 B/s"
    assert not traffic.advance(now=106.9)
