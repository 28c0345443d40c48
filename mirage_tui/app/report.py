"""The Report screen: how the run ended, per node and rank, what went wrong, where the logs are.

It lays out :func:`mirage_tui.reports.report.render`'s text of the run's fold, its first line in colour.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from mirage_tui.reports import report
from mirage_tui.state.runstate import Outcome, RunState


class ReportScreen(Screen):
    """The summary of a finished run (exit codes, durations, findings, log paths)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("o", "open_run_dir", "Open run dir",
                tooltip="show the run directory's path; open it with xdg-open where there is one"),
        Binding("escape,r", "app.pop_screen", "Back to the run", key_display="esc",
                tooltip="back to the Run screen (esc or r)"),
        Binding("R", "restart", "Restart", tooltip="start the same topology again (a replay: from the start)"),
        Binding("N", "new_run", "New run", tooltip="back to the Setup form, filled with this run's topology"),
    ]

    def __init__(self, state: RunState, outcome: Outcome, run_dir: str, skipped: int = 0) -> None:
        super().__init__()
        self.outcome = outcome
        self.run_dir = run_dir
        self.text = report.render(state, outcome, run_dir, skipped)

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="report"):
            yield Static(id="report-text")
        yield Footer()

    def on_mount(self) -> None:
        """Fill in the report; the status line takes the theme's success or error colour."""
        ok = self.outcome.returncode == 0
        self.sub_title = f"report: {'ok' if ok else 'FAILED'}, exit {self.outcome.returncode}"
        self.query_one("#report").border_title = "report"
        head, _, rest = self.text.partition("\n")
        theme = self.app.current_theme
        colour = (theme.success if ok else theme.error) or ""
        self.query_one("#report-text", Static).update(Text.assemble((head, f"bold {colour}"), "\n", rest))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A new run from the form only after a live run (a replay has no form to go back to)."""
        if action == "new_run":
            screen = self.app.run_screen
            return screen is not None and not screen.replaying
        return True

    def action_restart(self) -> None:
        """Start the same topology (or the same replay) again."""
        self.app.restart()

    def action_new_run(self) -> None:
        """Back to the Setup form, filled with this run's topology."""
        self.app.new_run()

    def action_open_run_dir(self) -> None:
        """Show the run directory's path, and open it in the desktop's file manager where there is one."""
        opener = shutil.which("xdg-open")
        if opener is None:
            self.notify(f"run dir: {self.run_dir}", timeout=10)
            return
        # a list argv, no shell: the path is data, never a command line
        subprocess.Popen([opener, self.run_dir], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
        self.notify(f"opening {self.run_dir}", timeout=10)
