"""The straggler detector: one rank consistently last to arrive, by a large margin.

Not a failure — the run goes on — but the first thing to look at when a job is
slower than it should be: every other rank waits in each collective for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from emulator.ledger import Communicator, Posted
from wire.schema import StragglerWarning

#: A rank this much later than the first arrival counts as late...
MARGIN_S = 0.25
#: ...and this many late arrivals in a row make it a straggler.
STREAK = 5


@dataclass
class _Streak:
    rank: int = -1
    count: int = 0
    margins: list[float] = field(default_factory=list)


class StragglerDetector:
    """Watches the arrival order of every matched collective, per communicator."""

    def __init__(self, margin_s: float = MARGIN_S, streak: int = STREAK):
        self.margin_s = margin_s
        self.streak = streak
        self._streaks: dict[str, _Streak] = {}
        self._warned: set[tuple[str, int]] = set()  # once per (communicator, rank), not once per streak

    def observe(self, comm: Communicator, matched: list[Posted]) -> StragglerWarning | None:
        """Record one matched collective; return a warning when a streak reaches its length."""
        if len(matched) < 2:
            return None
        arrivals = sorted(matched, key=lambda p: p.at)
        last = arrivals[-1]
        margin = last.at - arrivals[-2].at  # behind everyone else, not just the first
        if margin < self.margin_s:
            self._streaks.pop(comm.comm, None)
            return None
        rank = comm.members[last.request.rank].global_rank
        st = self._streaks.get(comm.comm)
        if st is None or rank != st.rank:
            st = self._streaks[comm.comm] = _Streak(rank=rank)
        st.count += 1
        st.margins.append(margin)
        if st.count >= self.streak and (comm.comm, rank) not in self._warned:
            self._warned.add((comm.comm, rank))
            return StragglerWarning(
                comm=comm.comm, rank=rank, count=st.count, mean_margin_s=round(sum(st.margins) / len(st.margins), 3)
            )
        return None
