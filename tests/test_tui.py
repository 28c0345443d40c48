"""The interactive console, driven by Textual's Pilot against real (short) runs and recorded ones."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from textual.widgets import Button, DataTable, Input, Log, Static, TextArea, Tree  # noqa: E402

from mirage_tui import replay  # noqa: E402
from mirage_tui.app import launch, topology_file  # noqa: E402
from mirage_tui.app.app import MirageApp  # noqa: E402
from mirage_tui.app.confirm import ConfirmScreen  # noqa: E402
from mirage_tui.app.report import ReportScreen  # noqa: E402
from mirage_tui.app.run_screen import RunScreen  # noqa: E402
from mirage_tui.app.setup import SetupScreen  # noqa: E402
from mirage_tui.topology import Topology, UsageError, validate  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "ml"
#: A recorded demo run (DDP MLP, 2 GPUs, 5 steps), committed so replays are deterministic.
RECORDED_RUN = REPO_ROOT / "tests" / "fixtures" / "runs" / "ddp-2gpu"
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
        assert all(label.endswith("exited") for label in _tree_labels(run)), _tree_labels(run)
        # selecting rank 1 swaps the log to its output
        tree = run.query_one("#ranks", Tree)
        tree.select_node(run._rank_items[1])
        await pilot.pause(0.2)
        assert log.border_title == "rank 1 output"
        assert not any("ddp_mlp_ok" in line for line in log.lines)  # only rank 0 prints it
        tree.select_node(run._rank_items[0])
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

    _run_app(app, body)


def test_quit_while_running_tears_the_run_down(tmp_path):
    app = MirageApp(_topology(tmp_path, "skip_allreduce.py"))  # rank 1 sleeps for 2 minutes

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        await _until(pilot, "ranks to register", lambda: len(_tree_labels(app.run_screen)) == 2)
        started = time.monotonic()
        await pilot.press("s")  # stacks of live ranks land in the alerts pane
        alerts = app.run_screen.query_one("#alerts-text", Static)
        await _until(pilot, "the stack dump", lambda: "--- rank 1 stacks ---" in str(alerts.content))
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


def test_kill_rank_from_the_console_shows_the_dead_peer(tmp_path):
    # launched directly, one process per node: no torchrun agent tears rank 0 down before the daemon
    # notices its peer is gone. Rank 1 sleeps; rank 0 waits for it in an all_reduce.
    app = MirageApp(Topology(num_nodes=2, log_dir=str(tmp_path),
                             command=(sys.executable, str(FIXTURES / "skip_allreduce.py"))))

    async def body(pilot) -> None:
        await _until(pilot, "the run screen", lambda: app.run_screen is not None)
        run = app.run_screen
        await _until(pilot, "rank 0 in its all_reduce", lambda: "in collective" in " ".join(_tree_labels(run)))
        run.query_one("#ranks", Tree).select_node(run._rank_items[1])
        await pilot.pause(0.1)
        await pilot.press("k")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await _until(pilot, "the run to end", lambda: app.outcome is not None)
        assert app.outcome.returncode != 0
        await _until_report(app, pilot)
        assert "dead peer: communicator" in app.screen.text, app.screen.text
        assert "killed rank 1 (pid" in str(run.query_one("#alerts-text", Static).content)

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
    assert all(label.endswith("exited") for label in states[0][0])


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
        player.speed = 0  # the rest as fast as possible
        await pilot.press("space")
        await _replay_to_end(app, pilot)

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
    single = launch.build(launch.TORCHRUN, ("python", *script), 1, 4)
    assert single[1:] == ("--standalone", "--nproc_per_node=4", *script)
    assert launch.launch_form(single) == launch.TORCHRUN and launch.program(single) == list(script)
    multi = launch.build(launch.TORCHRUN, single, 2, 4)
    assert multi[:2] == ("sh", "-c") and "--node_rank=$RANK" in multi[2]
    assert launch.launch_form(multi) == launch.TORCHRUN and launch.program(multi) == list(script)
    direct = launch.build(launch.DIRECT, multi, 2, 4)
    assert direct[1:] == script and launch.launch_form(direct) == launch.DIRECT
    assert launch.program(("torchrun", "--nproc-per-node", "8", "t.py")) == ["t.py"]


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


def test_replay_of_a_directory_without_events_is_a_usage_error(tmp_path, capsys):
    from mirage_tui.cli import tui_main

    assert tui_main(["--replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no events.jsonl" in err[0]
    assert tui_main(["--theme", "pink"]) == 2
    assert "--theme must be one of dark, high-contrast, light" in capsys.readouterr().err


def test_batch_and_cli_do_not_import_textual():
    code = "import sys, mirage_tui.batch, mirage_tui.cli, mirage_tui.replay; print('textual' in sys.modules)"
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
        screen.query_one("#ranks", Tree).select_node(screen._rank_items[1])
        await pilot.pause(0.1)
        assert log.border_title == "rank 1 output" and not any("ddp_mlp_ok" in line for line in log.lines)
        assert any("ddp_mlp_ok" in line for line in pinned.lines)
        await pilot.press("v")
        assert not pinned.display

    _run_app(app, body)


def test_gpu_pane_shows_memory_reports_with_history():
    from emulator import schema as s

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


def test_traffic_line_shows_collectives_in_flight_and_throughput():
    from emulator import schema as s
    from mirage_tui.app.traffic import Traffic

    mib = 2**20
    traffic = Traffic()
    for e in (s.CollectiveCompleted(t=100.2, comm="c" * 16, seq=1, total_bytes=4 * mib),
              s.CollectiveCompleted(t=102.5, comm="c" * 16, seq=2, total_bytes=8 * mib),
              s.CollectiveStarted(t=102.6, comm="c" * 16, seq=3, total_bytes=64 * mib),
              s.CollectiveProgress(t=102.7, comm="c" * 16, seq=3, done_bytes=16 * mib, total_bytes=64 * mib),
              s.OutputLine(t=102.8, rank=0, text="not traffic")):
        traffic.apply(e)
    # one character per second (the idle second 101 included), the last second's rate, then the wave's progress
    assert traffic.line() == ("throughput ▄ █ 8.0 MiB/s · in flight: allreduce #3 of cccccccc ██░░░░░░░░ 25%")
