"""The Run screen's GPU pane: memory used of total per emulated device, with a bar and its history."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.widgets import Static

from emulator import schema as s
from mirage_tui.app.glyphs import bar, sparkline
from mirage_tui.runstate import human_bytes

#: Samples of history kept (and drawn) per device; the pane is narrow (it sits under the rank tree).
HISTORY = 10
BAR = 8

Key = tuple[int, int]  # (rank, the node's GPU index), as RunState keys its memory


class GpuMemory(Static):
    """One line per (rank, GPU): allocated of total as a bar and in bytes, then the recent allocations.

    Peaks and reserved memory are in ``mirage status`` and the run's report.json.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("no GPU memory reported yet", markup=False, **kwargs)
        self._history: dict[Key, deque[int]] = {}  # allocated bytes, oldest first

    def record(self, e: s.MemoryUsage) -> None:
        """Add one report to its device's history (the pane redraws on :meth:`redraw`, once per batch)."""
        key = (e.rank, e.device)
        self._history.setdefault(key, deque(maxlen=HISTORY)).append(e.allocated)

    def redraw(self, latest: dict[Key, s.MemoryUsage]) -> None:
        """Draw every device's line from the latest reports (the run's fold keeps them)."""
        warn = self.app.current_theme.warning or ""
        lines = []
        for key in sorted(latest):
            m = latest[key]
            fraction = m.allocated / m.total if m.total else 0.0
            colour = warn if fraction > 0.9 else ""  # close to out of memory
            lines.append(Text.assemble(
                f"r{m.rank} g{m.device} ", (bar(fraction, BAR), colour), f" {human_bytes(m.allocated)}/{human_bytes(m.total)} ",
                sparkline(self._history.get(key, ())),
            ))
        self.update(Text("\n").join(lines))
