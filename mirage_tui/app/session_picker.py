"""``mirage-tui --attach`` with several live sessions and none named: pick one."""

from __future__ import annotations

import shlex
import time
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Footer, Header, OptionList
from textual.widgets.option_list import Option

from mirage_tui.session.registry import SessionEntry


def describe(entry: SessionEntry, now: float) -> str:
    """One line of the list: id, age, topology, profile, command."""
    age = int(now - entry.started)
    clocked = f" {entry.exec_mode}" if entry.exec_mode != "functional" else ""
    return (f"{entry.session}  {age // 60}m{age % 60:02d}s  {entry.num_nodes}x{entry.gpus_per_node}{clocked}  "
            f"{entry.profile}  pid {entry.pid}  {shlex.join(entry.command)}")


class SessionPicker(Screen[SessionEntry]):
    """The live sessions, newest first; Enter attaches to the highlighted one."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.quit", "Quit", show=False)]

    def __init__(self, entries: list[SessionEntry]) -> None:
        super().__init__()
        self.entries = sorted(entries, key=lambda e: -e.started)

    def compose(self) -> ComposeResult:
        yield Header()
        now = time.time()
        yield OptionList(*(Option(describe(e, now), id=e.session) for e in self.entries), id="sessions")
        yield Footer()

    def on_mount(self) -> None:
        """Title the list and give it the keys."""
        self.sub_title = f"{len(self.entries)} live sessions: Enter attaches, q quits"
        self.query_one(OptionList).border_title = "live sessions"
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Attach to the picked session."""
        self.dismiss(next(e for e in self.entries if e.session == event.option.id))
