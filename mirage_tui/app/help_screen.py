"""The ``?`` screen: every key of every screen, read from the screens' own bindings so it cannot go stale."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from mirage_tui.app.report import ReportScreen
from mirage_tui.app.run_screen import RunScreen
from mirage_tui.app.setup import SetupScreen
from mirage_tui.app.stacks_screen import StacksScreen

#: Where each group of keys applies (the app's own keys follow, as "Anywhere").
_SCREENS = (("Setup form", SetupScreen), ("Run screen (live run or replay)", RunScreen),
            ("Report screen", ReportScreen), ("Stacks", StacksScreen))
#: Keys that belong to a screen's widgets rather than to the screen, but that the screen is used with.
_WIDGET_KEYS = {
    SetupScreen: [("enter", "Start", "in a field or on Start: start the run"),
                  ("→", "Complete", "in the command field: take the file-name completion")],
    RunScreen: [("enter", "Select", "in the tree: show that rank's (node's) output; in the grid: pick that "
                                    "row's rank"),
                ("shift+↑ / ↓", "Node", "in the tree: jump to the previous / next node"),
                ("arrows, enter", "Rank grid", "past 16 ranks: move between cells (↑/↓: the next line of cells); "
                                               "enter or a click shows the rank's output"),
                ("tab", "Next pane", "move between the tree, the output, the grid and the other panes")],
}


def key_text(binding: Binding) -> str:
    """How a binding's keys read: its display form, else its keys joined by a slash."""
    return binding.key_display or " / ".join(binding.key.split(","))


def keys_table(title: str, rows: list[tuple[str, str, str]]) -> Table:
    """One group of keys under its title: key, name, what it does."""
    table = Table(title=title, title_justify="left", title_style="bold underline", box=None, show_header=False,
                  padding=(0, 2, 0, 0), expand=True)
    table.add_column("key", style="bold", no_wrap=True, min_width=12)
    table.add_column("name", no_wrap=True, min_width=16)
    table.add_column("what", ratio=1)
    for row in rows:
        table.add_row(*row)
    return table


def binding_rows(bindings: list[BindingType]) -> list[tuple[str, str, str]]:
    """The rows of a screen's bindings."""
    rows = []
    for binding in bindings:
        assert isinstance(binding, Binding)  # ours are all Binding instances
        rows.append((key_text(binding), binding.description, binding.tooltip))
    return rows


class HelpScreen(ModalScreen[None]):
    """Every key, grouped by screen; esc or ? closes it. The command palette (ctrl+p) lists the keys
    that work on the current screen right now."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark", "dismiss", "Close", key_display="esc")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(id="help-text")

    def on_mount(self) -> None:
        """Fill the table from the screens' bindings and the app's."""
        self.query_one("#help").border_title = "keys (esc closes)"
        tables = [keys_table(title, [*binding_rows(list(screen.BINDINGS)), *_WIDGET_KEYS.get(screen, [])])
                  for title, screen in _SCREENS]
        tables.append(keys_table("Anywhere", [
            *binding_rows(list(self.app.BINDINGS)),
            ("ctrl+p", "Palette", "the command palette: the keys that work here and now, searchable"),
            ("mouse", "", "click a rank in the tree, a grid row, a footer key or a button; the wheel scrolls"),
        ]))
        self.query_one("#help-text", Static).update(Group(*(part for t in tables for part in (t, Text()))))
