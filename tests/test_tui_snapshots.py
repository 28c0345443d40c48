"""Snapshots of the console's three screens (pytest-textual-snapshot), all from fixed inputs.

The Run and Report screens replay the committed recording in
``tests/fixtures/runs/ddp-2gpu`` as fast as possible, so no live timing reaches
a snapshot; paths are relative to the repository root. After a deliberate
change to a screen: ``pytest tests/test_tui_snapshots.py --snapshot-update``,
look at the SVGs under ``tests/__snapshots__/``, and refresh the PNGs in
``docs/screenshots/`` (see docs/console.md).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("pytest_textual_snapshot")

import many_ranks_events  # noqa: E402

from mirage_tui.app import app as app_module  # noqa: E402
from mirage_tui.app.app import MirageApp  # noqa: E402
from mirage_tui.app.feeds import STOPPED_EXIT, ReplayFeed  # noqa: E402
from mirage_tui.app.report import ReportScreen  # noqa: E402
from mirage_tui.config.topology import Topology  # noqa: E402
from mirage_tui.state import replay  # noqa: E402
from mirage_tui.state.runstate import Outcome  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RECORDED_RUN = "tests/fixtures/runs/ddp-2gpu"  # relative: the snapshot shows the path as given
RECORDED_HANG = "tests/fixtures/runs/hang-2gpu"
RECORDED_HANG_2HOST = "tests/fixtures/runs/hang-2host"
RECORDED_32 = "tests/fixtures/runs/allreduce-32gpu"
CLOCKED = "tests/fixtures/runs/clocked-4gpu"  # made by tests/clocked_events.py: a known slow rank
SIZE = (140, 45)
DEMO = Topology(gpus_per_node=2, command=("torchrun", "--standalone", "--nproc_per_node=2",
                                          "tests/fixtures/ml/ddp_mlp.py"))


@pytest.fixture(autouse=True)
def fixed_surroundings(monkeypatch):
    """Paths relative to the repository root; no animation; colour on whatever the caller's terminal says;
    torchrun on PATH (the form checks the command as the command line does) even in a venv not activated."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _app(**kw) -> MirageApp:
    app = MirageApp(**kw)
    app.animation_level = "none"
    return app


async def _until_report(pilot) -> None:
    app = pilot.app
    for _ in range(200):
        if isinstance(app.screen, ReportScreen) and app.screen.is_mounted:
            break
        await pilot.pause(0.05)
    assert isinstance(app.screen, ReportScreen), "the replay did not reach its report"
    await pilot.pause(0.1)


async def _to_the_run(pilot) -> None:
    """The replay to its end, then back from the report to the run screen."""
    await _until_report(pilot)
    await pilot.press("escape")
    await pilot.pause(0.1)


def test_setup_screen(snap_compare):
    # the default last-run path is only written when a run starts; nothing starts here
    assert snap_compare(_app(topology=DEMO, setup=True, demo=DEMO), terminal_size=SIZE)


def test_run_screen(snap_compare):
    app = _app(recording=replay.load(RECORDED_RUN), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_to_the_run)


def test_report_screen(snap_compare):
    app = _app(recording=replay.load(RECORDED_RUN), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_until_report)


async def _back_to_the_run(pilot, *keys: str) -> None:
    """From the report back to the Run screen, then ``keys``."""
    await _until_report(pilot)
    await pilot.press("escape", *keys)
    await pilot.pause(0.2)


def test_hang_stacks_screen(snap_compare):
    # the alert's key: the stacks the session took at the hang, the missing rank's first
    app = _app(recording=replay.load(RECORDED_HANG), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=lambda pilot: _back_to_the_run(pilot, "h"))


def test_run_screen_of_a_hang_over_two_hosts(snap_compare):
    """A --launcher slurm run: each node says which host it ran on, the alert which rank is missing."""
    async def to_the_hang_alert(pilot) -> None:
        await _back_to_the_run(pilot)
        pilot.app.screen.query_one("#alerts").scroll_home(animate=False)
        await pilot.pause(0.1)

    app = _app(recording=replay.load(RECORDED_HANG_2HOST), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=to_the_hang_alert)


def test_run_screen_with_a_hang(snap_compare):
    async def to_the_hang_alert(pilot) -> None:
        await _back_to_the_run(pilot)
        pilot.app.screen.query_one("#alerts").scroll_home(animate=False)  # the hang report, not the run's end
        await pilot.pause(0.1)

    app = _app(recording=replay.load(RECORDED_HANG), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=to_the_hang_alert)


def test_run_screen_32_ranks(snap_compare):
    app = _app(recording=replay.load(RECORDED_32), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_back_to_the_run)


def test_help_screen(snap_compare):
    app = _app(recording=replay.load(RECORDED_RUN), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=lambda pilot: _back_to_the_run(pilot, "question_mark"))


def test_recordings_are_relative():
    # snapshots must not depend on where the repository is checked out
    for run in (RECORDED_RUN, RECORDED_HANG, RECORDED_32):
        assert not os.path.isabs(run)
        for name in ("events.jsonl", "hang-report.json"):
            path = REPO_ROOT / run / name
            assert not path.exists() or not any(p in path.read_text() for p in ("/tmp/", str(REPO_ROOT))), path


def test_run_screen_of_a_clocked_run(snap_compare):
    """The clocked timeline: rank 2's lane solid, the others waiting (░) for it before each all-reduce."""
    app = _app(recording=replay.load(CLOCKED), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_to_the_run)


def test_report_screen_of_a_clocked_run(snap_compare):
    app = _app(recording=replay.load(CLOCKED), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_until_report)


class _HeldReplay(ReplayFeed):
    """Plays its recording as fast as it can, then holds there paused, as a user who paused a replay mid-run:
    the Run screen shows the run in progress (a synthetic recording has no end; a replayed end would put the
    Report up and every rank's state to exited)."""

    def __init__(self, recording: replay.Recording, speed: float = 0) -> None:
        super().__init__(recording, speed)
        self._released = threading.Event()

    def _request_stop(self) -> None:
        super()._request_stop()
        self._released.set()

    def _run(self) -> None:
        assert self._target is not None
        for event in self.player:
            self._push(event)
        self.player.toggle_pause()
        self._target.post_message(self.progress())
        self._released.wait()
        self._finish(Outcome(STOPPED_EXIT, "replay stopped", self.recording.run_dir))


def _many_ranks_app(monkeypatch, ranks: int) -> MirageApp:
    """A synthetic run of ``ranks`` ranks (tests/many_ranks_events.py) held part-way through a step."""
    monkeypatch.setattr(app_module, "ReplayFeed", _HeldReplay)
    recording = replay.Recording(f"synthetic-{ranks}-ranks", tuple(many_ranks_events.events(ranks)), 0)
    return _app(recording=recording, speed=0)


async def _until_held(pilot, *keys: str) -> None:
    """Until every event is drawn and the replay holds, then ``keys``."""
    app = pilot.app
    for _ in range(400):
        screen = app.run_screen
        if screen is not None and screen.feed.player.paused and not screen.feed.buffer \
                and screen.state.events == screen.feed.player.total:
            break
        await pilot.pause(0.05)
    await pilot.pause(0.2)
    await pilot.press(*keys)
    await pilot.pause(0.2)


def test_run_screen_64_ranks(snap_compare, monkeypatch):
    """Past 16 ranks the grid, the communicators' progress and memory's distribution replace the per-rank views."""
    app = _many_ranks_app(monkeypatch, 64)
    assert snap_compare(app, terminal_size=SIZE, run_before=_until_held)


def test_run_screen_256_ranks_at_the_first_laggard(snap_compare, monkeypatch):
    """256 ranks on 4 hosts: b puts the cursor on the first rank the others wait for and shows its output."""
    app = _many_ranks_app(monkeypatch, 256)
    assert snap_compare(app, terminal_size=SIZE, run_before=lambda pilot: _until_held(pilot, "b"))
