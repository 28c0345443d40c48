"""The interactive console, driven by Textual's Pilot against real (short) runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from textual.widgets import DataTable, Log, Static, Tree  # noqa: E402

from mirage_tui.app.app import MirageApp  # noqa: E402
from mirage_tui.topology import Topology  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "ml"
SIZE = (140, 45)
DEADLINE_S = 60.0
#: Set to a path (e.g. docs/screenshots/run.svg) to keep the demo run's final screen.
SCREENSHOT_ENV = "MIRAGE_TUI_SCREENSHOT"

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture(autouse=True)
def workload_env(monkeypatch):
    """Short runs, and torchrun from this venv even when it is not activated."""
    monkeypatch.setenv("STEPS", "5")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _topology(tmp_path: Path, script: str, **kw) -> Topology:
    return Topology(
        gpus_per_node=2, log_dir=str(tmp_path),
        command=("torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / script)), **kw,
    )


def _tree_labels(app: MirageApp) -> list[str]:
    tree = app.query_one("#ranks", Tree)
    return [str(leaf.label) for node in tree.root.children for leaf in node.children]


def _completed_seqs(app: MirageApp) -> list[int]:
    grid = app.query_one("#collectives", DataTable)
    return [int(grid.get_row(key)[4]) for key in grid.rows]


async def _until(pilot, what, condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.2)


def test_demo_run_fills_tree_output_and_grid(tmp_path):
    app = MirageApp(_topology(tmp_path, "ddp_mlp.py"))

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, "ranks 0 and 1 in the tree",
                         lambda: {"rank 0", "rank 1"} <= {" ".join(label.split()[1:3]) for label in _tree_labels(app)})
            log = app.query_one("#output", Log)
            await _until(pilot, "rank 0's ddp_mlp_ok", lambda: any("ddp_mlp_ok" in line for line in log.lines))
            await _until(pilot, "the run to finish", lambda: app.outcome is not None)
            assert app.outcome.returncode == 0, app.outcome.summary
            assert max(_completed_seqs(app), default=0) > 0
            assert all(label.endswith("exited") for label in _tree_labels(app)), _tree_labels(app)
            # selecting rank 1 swaps the log to its output
            tree = app.query_one("#ranks", Tree)
            tree.select_node(app._rank_items[1])
            await pilot.pause(0.2)
            assert log.border_title == "rank 1 output"
            assert not any("ddp_mlp_ok" in line for line in log.lines)  # only rank 0 prints it
            tree.select_node(app._rank_items[0])
            await pilot.pause(0.2)
            assert any("ddp_mlp_ok" in line for line in log.lines)
            await pilot.press("t")
            assert app.theme == "mirage-high-contrast"  # the themes after the default, by file name
            await pilot.press("t", "t")
            assert app.theme == "mirage-dark"
            shot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "run.svg")
            shot.parent.mkdir(parents=True, exist_ok=True)
            app.save_screenshot(filename=shot.name, path=str(shot.parent))
            assert "ddp_mlp_ok" in shot.read_text()
            await pilot.press("q")
        assert app.return_code == 0

    try:
        asyncio.run(main())
    finally:
        app.stop_session()


def test_hang_shows_missing_rank_in_alerts(tmp_path):
    app = MirageApp(_topology(tmp_path, "skip_allreduce.py", hang_timeout_s=2.0))

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            alerts = app.query_one("#alerts-text", Static)
            await _until(pilot, "the hang report", lambda: "missing ranks: {1}" in str(alerts.content))
            await _until(pilot, "the run to finish", lambda: app.outcome is not None)
            assert app.outcome.returncode == 124

    try:
        asyncio.run(main())
    finally:
        app.stop_session()


def test_quit_while_running_tears_the_run_down(tmp_path):
    app = MirageApp(_topology(tmp_path, "skip_allreduce.py"))  # rank 1 sleeps for 2 minutes

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, "ranks to register", lambda: len(_tree_labels(app)) == 2)
            started = time.monotonic()
            await pilot.press("s")  # stacks of live ranks land in the alerts pane
            alerts = app.query_one("#alerts-text", Static)
            await _until(pilot, "the stack dump", lambda: "--- rank 1 stacks ---" in str(alerts.content))
            await pilot.press("q")
            await _until(pilot, "the run to stop", lambda: app.outcome is not None)
            assert time.monotonic() - started < 30
            await pilot.pause(0.2)
        assert app.return_code == 130  # stopped, as a Ctrl-C in batch mode
        assert app.outcome.returncode == 130

    try:
        asyncio.run(main())
    finally:
        app.stop_session()


def test_batch_and_cli_do_not_import_textual():
    code = "import sys, mirage_tui.batch, mirage_tui.cli; print('textual' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


def test_demo_command_points_at_the_bundled_fixture():
    from mirage_tui.cli import _demo_command

    cmd = _demo_command(2)
    assert cmd[1:3] == ("--standalone", "--nproc_per_node=2") and Path(cmd[-1]).is_file()


def test_themes_load_with_rank_state_variables():
    from mirage_tui.app.themes import THEMES_DIR, load_theme

    names = set()
    for path in sorted(THEMES_DIR.glob("*.toml")):
        theme = load_theme(path)
        names.add(theme.name)
        assert {"rank-running", "rank-collective", "rank-stuck", "rank-missing", "rank-exited"} <= set(theme.variables)
    assert {"mirage-dark", "mirage-light", "mirage-high-contrast"} <= names

