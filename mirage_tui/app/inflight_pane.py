"""The Run screen's traffic pane: the throughput sparkline, then a progress bar per collective in flight."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.widgets import Static

from mirage_tui.state.traffic import Traffic


class InFlightPane(Static):
    """Draws a :class:`Traffic` fold: throughput first, then every collective the daemon is reducing."""

    def __init__(self, **kwargs) -> None:
        super().__init__("no collective yet", markup=False, **kwargs)
        self._line_count = 1

    def redraw(self, traffic: Traffic, now: float, name: Callable[[str], str] | None = None) -> None:
        """Draw ``traffic`` with ages as of ``now`` (the run's clock: a replay's is its events'), communicators
        as ``name`` names them."""
        lines = traffic.lines(now, name)
        head = Text(traffic.throughput(), style="bold")
        if not lines:
            self._show(Text.assemble(head, "\nno collective in flight"), 2)
            return
        head.append(f" · {len(lines)} in flight", style="")
        accent = self.app.current_theme.accent or ""
        self._show(Text("\n").join([head, *(Text(line, style=accent) for line in lines)]), 1 + len(lines))

    def _show(self, text: Text, line_count: int) -> None:
        # a layout of the whole screen only when the height changes: at 256 ranks collectives start and
        # complete hundreds of times a second, and a layout per drain would cost more than the drain
        self.update(text, layout=line_count != self._line_count)
        self._line_count = line_count
