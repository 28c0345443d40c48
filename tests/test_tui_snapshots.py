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
from pathlib import Path

import pytest

pytest.importorskip("pytest_textual_snapshot")

from mirage_tui import replay  # noqa: E402
from mirage_tui.app.app import MirageApp  # noqa: E402
from mirage_tui.app.report import ReportScreen  # noqa: E402
from mirage_tui.topology import Topology  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RECORDED_RUN = "tests/fixtures/runs/ddp-2gpu"  # relative: the snapshot shows the path as given
SIZE = (140, 45)
DEMO = Topology(gpus_per_node=2, command=("torchrun", "--standalone", "--nproc_per_node=2",
                                          "tests/fixtures/ml/ddp_mlp.py"))


@pytest.fixture(autouse=True)
def fixed_surroundings(monkeypatch):
    """Paths relative to the repository root; no animation; colour on whatever the caller's terminal says."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("NO_COLOR", raising=False)


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


def test_setup_screen(snap_compare):
    # the default last-run path is only written when a run starts; nothing starts here
    assert snap_compare(_app(topology=DEMO, setup=True, demo=DEMO), terminal_size=SIZE)


def test_run_screen(snap_compare):
    async def to_the_run(pilot) -> None:
        await _until_report(pilot)
        await pilot.press("escape")
        await pilot.pause(0.1)

    app = _app(recording=replay.load(RECORDED_RUN), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=to_the_run)


def test_report_screen(snap_compare):
    app = _app(recording=replay.load(RECORDED_RUN), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_until_report)


def test_recording_is_relative():
    # snapshots must not depend on where the repository is checked out
    assert not os.path.isabs(RECORDED_RUN) and "/tmp/" not in (REPO_ROOT / RECORDED_RUN / "events.jsonl").read_text()
