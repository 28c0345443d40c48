"""Collective traffic: every collective in flight (bytes done, wave by wave) and the throughput history.

Part of the run's fold (:attr:`mirage_tui.state.runstate.RunState.traffic`). No Textual
here. Times are the events' own, so a replay draws what the live run drew.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mirage_tui.glyphs import bar, human_bytes, sparkline
from wire import schema as s

#: Seconds of throughput history drawn.
HISTORY_S = 20
#: Cells of a collective's progress bar.
BAR = 20


@dataclass
class InFlight:
    """A collective the daemon has started and not yet completed."""

    op: str
    done: int  # bytes reduced so far, as of the last wave the daemon reported
    total: int
    started: float


@dataclass
class Traffic:
    """Fold of the collective events: what is in flight, and bytes completed per second."""

    inflight: dict[tuple[str, int], InFlight] = field(default_factory=dict)  # (comm, seq), in start order
    per_second: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=HISTORY_S))  # (second, bytes)

    def apply(self, e: s.Event) -> bool:
        """Fold one event in; True if it changed what :meth:`lines` shows."""
        if isinstance(e, s.CollectiveStarted):
            self.inflight[(e.comm, e.seq)] = InFlight(e.op.value, 0, e.total_bytes, e.t)
        elif isinstance(e, s.CollectiveProgress):
            job = self.inflight.get((e.comm, e.seq))
            if job is None:  # a recording that starts mid-collective
                job = self.inflight[(e.comm, e.seq)] = InFlight("", 0, e.total_bytes, e.t)
            job.done, job.total = e.done_bytes, e.total_bytes
        elif isinstance(e, s.CollectiveCompleted):
            self.inflight.pop((e.comm, e.seq), None)
            self._count(int(e.t), e.total_bytes)
        elif isinstance(e, s.CommFailed):
            # a failed communicator's collectives never complete: they are no longer in flight
            gone = [key for key in self.inflight if key[0] == e.comm]
            for key in gone:
                del self.inflight[key]
            return bool(gone)
        else:
            return False
        return True

    def _count(self, second: int, nbytes: int) -> None:
        if self.per_second and self.per_second[-1][0] == second:
            self.per_second[-1] = (second, self.per_second[-1][1] + nbytes)
            return
        self._fill(second)
        self.per_second.append((second, nbytes))

    def _fill(self, second: int) -> None:
        """Seconds since the last completion, before ``second``, count as zero, so the sparkline keeps time."""
        if not self.per_second:
            return
        for idle in range(max(self.per_second[-1][0] + 1, second - HISTORY_S), second):
            self.per_second.append((idle, 0))

    def advance(self, now: float) -> bool:
        """Let the clock run to ``now`` with nothing completing (a live run's idle seconds); True if that
        changed the history."""
        before = self.per_second[-1] if self.per_second else None
        self._fill(int(now))
        return bool(self.per_second) and self.per_second[-1] != before

    def throughput(self) -> str:
        """``throughput ▁▃█ 1.2 GiB/s``: bytes of completed collectives per second, the last one's rate."""
        rates = [b for _, b in self.per_second]
        return f"throughput {sparkline(rates)} {human_bytes(rates[-1] if rates else 0)}/s"

    def lines(self, now: float, name: Callable[[str], str] | None = None) -> list[str]:
        """One line per collective in flight, oldest first: op, seq, communicator, bar, bytes, age at ``now``.

        ``name`` names a communicator (the fold's :meth:`~mirage_tui.state.runstate.RunState.comm_label`); without
        it, its id's first characters.
        """
        names = {comm: name(comm) if name else comm[:8] for comm, _ in self.inflight}
        width = max(map(len, names.values()), default=0)
        out = []
        for (comm, seq), job in self.inflight.items():
            fraction = job.done / job.total if job.total else 0.0
            out.append(f"{job.op or '?':<14} #{seq:<5} {names[comm]:<{width}} {bar(fraction, BAR)} {fraction:4.0%} "
                       f"{human_bytes(job.done)} of {human_bytes(job.total)}, {max(0.0, now - job.started):.1f} s")
        return out
