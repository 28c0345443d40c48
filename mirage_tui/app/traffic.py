"""Collective traffic for the grid's footer: collectives in flight (bytes done per wave) and throughput.

No Textual here. Times are the events' own, so a replay draws what the live run drew.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from emulator import schema as s
from mirage_tui.app.glyphs import bar, sparkline
from mirage_tui.runstate import human_bytes

#: Seconds of throughput history drawn.
HISTORY_S = 20


@dataclass
class Traffic:
    """Fold of the collective events: what is in flight, and bytes completed per second."""

    inflight: dict[tuple[str, int], tuple[str, int, int]] = field(default_factory=dict)  # (comm, seq) -> op, done, total
    per_second: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=HISTORY_S))  # (second, bytes)

    def apply(self, e: s.Event) -> bool:
        """Fold one event in; True if it changed what :meth:`line` shows."""
        if isinstance(e, s.CollectiveStarted):
            self.inflight[(e.comm, e.seq)] = (e.op.value, 0, e.total_bytes)
        elif isinstance(e, s.CollectiveProgress):
            op = self.inflight.get((e.comm, e.seq), ("", 0, 0))[0]
            self.inflight[(e.comm, e.seq)] = (op, e.done_bytes, e.total_bytes)
        elif isinstance(e, s.CollectiveCompleted):
            self.inflight.pop((e.comm, e.seq), None)
            second = int(e.t)
            if self.per_second and self.per_second[-1][0] == second:
                self.per_second[-1] = (second, self.per_second[-1][1] + e.total_bytes)
            else:
                # seconds with no completion count as zero, so the sparkline keeps time
                last = self.per_second[-1][0] if self.per_second else second
                for idle in range(max(last + 1, second - HISTORY_S), second):
                    self.per_second.append((idle, 0))
                self.per_second.append((second, e.total_bytes))
        else:
            return False
        return True

    def line(self) -> str:
        """``throughput ▁▃█ 1.2 GiB/s · in flight: allreduce #7 ████░░ 62%`` (the first collective in flight)."""
        rates = [b for _, b in self.per_second]
        parts = [f"throughput {sparkline(rates)} {human_bytes(rates[-1] if rates else 0)}/s"]
        if self.inflight:
            (comm, seq), (op, done, total) = next(iter(self.inflight.items()))
            fraction = done / total if total else 0.0
            more = f" (+{len(self.inflight) - 1})" if len(self.inflight) > 1 else ""
            parts.append(f"in flight: {op} #{seq} of {comm[:8]} {bar(fraction, 10)} {fraction:.0%}{more}")
        return " · ".join(parts)
