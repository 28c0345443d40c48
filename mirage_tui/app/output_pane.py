"""The Run screen's output pane: the selected rank's (or node process's) lines, and a pinned one beside them."""

from __future__ import annotations

import time
from collections import deque

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Log

from wire import schema as s

#: Lines kept per rank (and per node process); older ones are only in the run directory's logs.
MAX_LINES = 10_000

Source = tuple[str, int]  # ("rank", r) or ("node", n): whose output a Log shows


class OutputPane(Horizontal):
    """Every source's recent lines; shows the selected source's (and the pinned one's), filtered as asked.

    Lines come in with :meth:`take` and reach the Logs at :meth:`flush`, once per batch of events.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lines: dict[Source, deque[s.OutputLine]] = {}
        self.selected: Source | None = None
        self.pinned: Source | None = None  # shown beside the selected source, to compare two ranks
        # what the Logs show of their source's lines
        self.filter = ""
        self.show_stderr = True
        self.timestamps = False
        # per Log: lines of its source taken but not yet written to it
        self._unwritten: dict[str, list[str]] = {"output": [], "pinned": []}

    def compose(self) -> ComposeResult:
        yield Log(max_lines=MAX_LINES, id="output")
        yield Log(max_lines=MAX_LINES, id="pinned")

    def on_mount(self) -> None:
        """Title the output Log (a source's name replaces it once one is selected)."""
        self.query_one("#output", Log).border_title = "output"

    def take(self, e: s.OutputLine) -> None:
        """Keep one line, and queue it for the Logs that show its source."""
        source: Source = ("rank", e.rank) if e.rank >= 0 else ("node", e.node)
        self.lines.setdefault(source, deque(maxlen=MAX_LINES)).append(e)
        if self.shows(e):
            for log, shown in (("output", self.selected), ("pinned", self.pinned)):
                if source == shown:
                    self._unwritten[log].append(self.line_text(e))

    def flush(self) -> None:
        """Write the queued lines, one write per Log."""
        for log, lines in self._unwritten.items():
            if lines:
                self.query_one(f"#{log}", Log).write_lines(lines)
                self._unwritten[log] = []

    def select(self, source: Source) -> None:
        """Show ``source``'s lines."""
        if source != self.selected:
            self.selected = source
            self.refill(("output",))

    def toggle_pin(self) -> None:
        """Pin the selected source's lines beside the pane (then pick another to compare); again: unpin."""
        pinned = self.query_one("#pinned", Log)
        if self.pinned is not None or self.selected is None:
            self.pinned = None
            pinned.display = False
            return
        self.pinned = self.selected
        pinned.display = True
        self.refill(("pinned",))

    def set_filter(self, text: str) -> None:
        """Show only lines containing ``text`` (any case); empty: every line."""
        self.filter = text
        self.refill()

    def toggle_stderr(self) -> None:
        """Hide or show stderr lines."""
        self.show_stderr = not self.show_stderr
        self.refill()

    def toggle_timestamps(self) -> None:
        """Prefix each line with the time it was printed, or not."""
        self.timestamps = not self.timestamps
        self.refill()

    def shows(self, e: s.OutputLine) -> bool:
        """Whether the Logs show ``e`` under the current stderr toggle and filter."""
        if not self.show_stderr and e.stream is s.Stream.STDERR:
            return False
        return not self.filter or self.filter.lower() in e.text.lower()

    def line_text(self, e: s.OutputLine) -> str:
        """``e`` as a Log shows it (with its time, when timestamps are on)."""
        if not self.timestamps:
            return e.text
        stamp = time.strftime("%H:%M:%S", time.localtime(e.t))
        return f"{stamp}.{int(e.t * 1000) % 1000:03d} {e.text}"

    def refill(self, logs: tuple[str, ...] = ("output", "pinned")) -> None:
        """Redraw Logs for their source, the filter, the stderr toggle and timestamps."""
        for log in logs:
            source = self.selected if log == "output" else self.pinned
            if source is not None:
                self._refill(log, source)

    def _refill(self, log_id: str, source: Source) -> None:
        log = self.query_one(f"#{log_id}", Log)
        title = f"{source[0]} {source[1]} output" + (" (pinned)" if log_id == "pinned" else "")
        if self.filter:
            title += f" · lines with {self.filter!r}"
        if not self.show_stderr:
            title += " · stdout only"
        log.border_title = title
        log.clear()
        self._unwritten[log_id] = []  # the refill below includes them
        log.write_lines([self.line_text(e) for e in self.lines.get(source, ()) if self.shows(e)])
