"""The run at many ranks, summarised from the fold: every rank's state, who is behind, memory's distribution.

At 32 or 256 ranks a list per rank hides what matters: which ranks the others
wait for. This module reads a :class:`~mirage_tui.state.runstate.RunState` and
answers what the console's views for many ranks draw: a grid of ranks by host
and node, per communicator "k of N ranks at collective #s" with its laggards,
memory as a distribution with its outliers. It walks every communicator's
members once (not once per rank and communicator, as the tree's
:meth:`RunState.rank_state` does), so that it stays cheap enough to run on every
redraw at 256 ranks. No Textual: the screens only draw it, and
``tests/test_tui_fold.py`` checks it on its own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from mirage_tui.state.runstate import RunState

#: Above this many registered ranks the console switches to the views for many ranks (a key switches back):
#: up to two nodes of eight, the tree and the per-rank ledger still fit a terminal.
MANY_RANKS = 16

#: A cell's states, in the order the legend lists them. ``behind`` is the one the tree does not have: a live
#: rank that waits in no collective while another member of one of its communicators already posted a later
#: one, i.e. a rank the others wait for. A rank behind somewhere but waiting in a collective itself is shown
#: *in collective*: it is held up too, and colouring it as a culprit would hide the one that holds it.
CELL_STATES = ("running", "compiling", "in collective", "behind", "stuck", "missing", "exited 0", "exited", "failed")

#: Ops numbered per pair of ranks rather than per communicator (the names the fold's positions keep):
#: their sequence numbers say nothing about who is behind.
_P2P_OPS = ("SEND", "RECV")

#: A memory outlier lies this many interquartile ranges beyond the quartiles (Tukey's fences) ...
_FENCE_IQR = 1.5
#: ... and at least this far from them, relative to the median and in bytes: identical replicas have no
#: spread at all, and a few bytes' difference is not worth a name.
_FENCE_MEDIAN = 0.05
_FENCE_BYTES = 1 << 20


@dataclass(frozen=True)
class Laggard:
    """A member of a communicator behind its frontier: the last collective it posted and what it does now."""

    rank: int
    seq: int  # the last collective it posted on this communicator (0: none yet)
    op: str  # that collective's op ("" before any)
    state: str  # its cell state: behind (computing towards the next post), stuck, missing, failed, ...
    waits_in: str = ""  # where it waits itself, held up by another ("mesh_tp (794f54dd) #7"), if it does


@dataclass(frozen=True)
class CommProgress:
    """One communicator at a glance: ``at`` of ``size`` ranks posted collective #``seq``; the laggards not."""

    comm: str
    label: str
    size: int
    seq: int  # the frontier: the highest sequence number a member posted (0: none yet)
    op: str  # the frontier collective's op
    at: int  # members that posted it
    completed: int  # the highest sequence number completed
    laggards: tuple[Laggard, ...]  # every member behind the frontier, furthest behind first
    unjoined: int  # members that have not joined yet (its size less the members the fold knows)
    waiting_s: float  # since the frontier's first post, until it starts (0: nobody waits for it)
    failed: str  # the communicator's failure, if any

    @property
    def settled(self) -> bool:
        """Whether every member reached the frontier and it completed: nobody waits here."""
        return not self.laggards and not self.unjoined and self.completed >= self.seq


@dataclass(frozen=True)
class NodeCells:
    """One node's registered ranks in rank order, each with its cell state."""

    node: int
    host: str  # "" when the run has one host
    ranks: tuple[tuple[int, str], ...]


@dataclass
class Summary:
    """Every registered rank's cell state, grouped by host and node; the communicators' progress; the counts."""

    hosts: dict[str, list[NodeCells]] = field(default_factory=dict)  # host ("": one host) -> its nodes in order
    states: dict[int, str] = field(default_factory=dict)  # rank -> cell state
    counts: dict[str, int] = field(default_factory=dict)  # cell state -> ranks, in CELL_STATES order
    comms: list[CommProgress] = field(default_factory=list)  # in the order they were created
    behind_in: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)  # rank -> (comm, its, frontier)

    def order(self) -> list[int]:
        """The ranks as the grid lays them out: by host, node, rank."""
        return [rank for nodes in self.hosts.values() for cells in nodes for rank, _ in cells.ranks]


def summarize(state: RunState, now: float | None = None) -> Summary:
    """Every registered rank's cell state and every communicator's progress, as of ``now`` (the run's clock)."""
    now = state.last_t if now is None else now
    in_coll: dict[int, tuple[str, int]] = {}  # rank -> a collective it waits in: (communicator, seq)
    behind_in: dict[int, list[tuple[str, int, int]]] = {}
    frontiers = []  # (communicator, frontier seq, its op, the members behind it)
    for c in state.comms.values():
        seq, op = 0, ""
        for pos in c.ranks.values():
            if pos.op not in _P2P_OPS and pos.last_enqueued > seq:
                seq, op = pos.last_enqueued, pos.op
        behind = []
        for rank, pos in c.ranks.items():
            if pos.last_enqueued > pos.last_completed:
                in_coll.setdefault(rank, (c.comm, pos.last_enqueued))
            if c.size > 1 and pos.op not in _P2P_OPS and pos.last_enqueued < seq:
                behind.append((rank, pos))
                behind_in.setdefault(rank, []).append((c.comm, pos.last_enqueued, seq))
        frontiers.append((c, seq, op, behind))

    summary = Summary(behind_in=behind_in, counts=dict.fromkeys(CELL_STATES, 0))
    nodes: dict[int, list[tuple[int, str]]] = {}
    hosts: dict[int, str] = {}  # node -> the host its first rank registered from
    for rank, status in sorted(state.ranks.items()):
        if status.node is None:
            continue  # named by a hang before it registered: the grid shows it once it does
        word = state.settled_state(rank) or ("compiling" if status.compiling else
            "in collective" if rank in in_coll else "behind" if rank in behind_in else "running")
        summary.states[rank] = word
        summary.counts[word] += 1
        nodes.setdefault(status.node, []).append((rank, word))
        if status.host:
            hosts.setdefault(status.node, status.host)
    several_hosts = len(set(hosts.values())) > 1
    for node in sorted(nodes):
        host = hosts.get(node, "") if several_hosts else ""
        summary.hosts.setdefault(host, []).append(NodeCells(node, host, tuple(nodes[node])))

    for c, seq, op, behind in frontiers:
        arriving = c.arriving.get(seq)
        summary.comms.append(CommProgress(
            comm=c.comm, label=state.comm_label(c.comm), size=c.size, seq=seq, op=op,
            at=sum(1 for pos in c.ranks.values() if pos.last_enqueued >= seq and pos.op not in _P2P_OPS),
            completed=max((pos.last_completed for pos in c.ranks.values()), default=0),
            laggards=tuple(sorted((Laggard(rank, pos.last_enqueued, pos.op, summary.states.get(rank, "running"),
                                           _waits_in(state, in_coll.get(rank)))
                                   for rank, pos in behind), key=lambda lag: (lag.seq, lag.rank))),
            unjoined=max(0, c.size - len(c.ranks)),
            waiting_s=max(0.0, now - arriving.first_t) if arriving is not None else 0.0,
            failed=c.failed))
    return summary


def _waits_in(state: RunState, where: tuple[str, int] | None) -> str:
    return "" if where is None else f"{state.comm_label(where[0])} #{where[1]}"


# ------------------------------------------------------------------ memory


@dataclass(frozen=True)
class Outlier:
    """One GPU whose allocated memory lies outside the distribution's fences."""

    rank: int
    device: int
    allocated: int
    high: bool  # above the upper fence (else below the lower)


@dataclass(frozen=True)
class MemoryDistribution:
    """The allocated memory of every (rank, GPU) the ranks reported, as a distribution with its outliers."""

    gpus: int
    total: int  # the largest GPU's capacity (emulated GPUs of one run share a profile)
    low: int
    p50: int
    p90: int
    high: int
    mean: float
    histogram: tuple[int, ...]  # GPUs per bin, ``bins`` equal bins from ``low`` to ``high``
    outliers: tuple[Outlier, ...]  # furthest from the median first
    near_full: int  # GPUs with more than 90% of their memory allocated
    _sorted: tuple[int, ...] = field(repr=False, compare=False, default=())

    def percentile_of(self, allocated: int) -> int:
        """Where ``allocated`` lies among the GPUs, 0..100 (the share of GPUs with less)."""
        if not self._sorted:
            return 0
        return round(100 * bisect.bisect_left(self._sorted, allocated) / len(self._sorted))


def _quantile(values: list[int], q: float) -> float:
    """Linear interpolation between the closest ranks of sorted ``values`` (numpy's default)."""
    at = q * (len(values) - 1)
    lo = int(at)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (at - lo)


def memory_distribution(state: RunState, bins: int = 24) -> MemoryDistribution | None:
    """The distribution of allocated memory over every GPU the ranks reported; None before any report."""
    reports = list(state.memory.values())
    if not reports:
        return None
    values = sorted(m.allocated for m in reports)
    low, high = values[0], values[-1]
    q1, median, q3 = (_quantile(values, q) for q in (0.25, 0.5, 0.75))
    reach = max(_FENCE_IQR * (q3 - q1), _FENCE_MEDIAN * median, _FENCE_BYTES)
    outliers = sorted(
        (Outlier(m.rank, m.device, m.allocated, m.allocated > q3)
         for m in reports if m.allocated > q3 + reach or m.allocated < q1 - reach),
        key=lambda o: (-abs(o.allocated - median), o.rank, o.device))
    histogram = [0] * bins
    span = high - low
    for v in values:
        histogram[min(bins - 1, (v - low) * bins // span) if span else 0] += 1
    return MemoryDistribution(
        gpus=len(values), total=max(m.total for m in reports), low=low, p50=round(median),
        p90=round(_quantile(values, 0.9)), high=high, mean=sum(values) / len(values), histogram=tuple(histogram),
        outliers=tuple(outliers), near_full=sum(1 for m in reports if m.total and m.allocated > 0.9 * m.total),
        _sorted=tuple(values))
