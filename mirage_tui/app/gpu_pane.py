"""The Run screen's GPU pane: memory used of total per emulated device, with a bar and its history."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from mirage_tui.glyphs import bar, human_bytes, sparkline
from mirage_tui.state.runstate import RunState

BAR = 8


class GpuMemory(Static):
    """One line per (rank, GPU): allocated of total as a bar and in bytes, then the recent allocations.

    Peaks and reserved memory are in ``mirage status`` and the run's report.json.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("no GPU memory reported yet", markup=False, **kwargs)

    def redraw(self, state: RunState) -> None:
        """Draw every device's line from the fold's latest reports and their history."""
        warn = self.app.current_theme.warning or ""
        lines = []
        for key in sorted(state.memory):
            m = state.memory[key]
            fraction = m.allocated / m.total if m.total else 0.0
            colour = warn if fraction > 0.9 else ""  # close to out of memory
            lines.append(Text.assemble(
                f"r{m.rank} g{m.device} ", (bar(fraction, BAR), colour),
                f" {human_bytes(m.allocated)}/{human_bytes(m.total)} ",
                sparkline(state.memory_history.get(key, ())),
            ))
        self.update(Text("\n").join(lines))
