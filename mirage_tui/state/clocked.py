"""The clocked part of the run's fold: every rank's steps and collectives in emulated time, and what is
derived from them (each rank's step figures, the run's predicted step, the timeline's lanes).

:class:`~mirage_tui.state.runstate.RunState` keeps the events (``clocked_steps``, ``clocked_colls``) and
answers through the functions here; they read those events and nothing else, so the rules of the
prediction and of the timeline read in one place. No Textual, no process, nothing drawn.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from wire import schema as s

#: Clocked collectives kept per communicator (their emulated start and end): the timeline draws the last
#: few steps only, and the step figures come from the ranks' own step reports, which are all kept.
CLOCKED_COLLECTIVES = 4096


@dataclass(frozen=True)
class ClockedColl:
    """One collective of one communicator in emulated time (clocked mode): every member runs it then."""

    comm: str
    seq: int
    op: str
    start: float  # emulated seconds
    end: float
    algo: str  # "ring/Simple", ...
    total_bytes: int


@dataclass(frozen=True)
class RankClock:
    """One rank's steps in emulated time, averaged over its *measured* steps: every step after the first.

    The first step is left out because it is warm-up: it carries one-off costs the steady state does
    not have (a communicator's first collective connecting its rings, DDP rebuilding its buckets, the
    optimizer allocating its state, the first kernels of every shape), and its start is the rank's first
    operation rather than the end of a step. A rank that reported a single step is measured on it.
    """

    rank: int
    node: int
    steps: int  # reported
    measured: int  # averaged over
    first_measured: int  # the step number the average starts at (2, or 1 when only one was reported)
    last_step: int  # the latest step number
    step_s: float  # mean step time
    last_step_s: float
    compute_s: float  # means, per step
    comm_s: float
    exposed_comm_s: float
    ops: int  # over every step reported
    bytes_only_ops: int


@dataclass(frozen=True)
class Prediction:
    """The run's predicted step time: a step of the run ends when its last rank's step ends.

    ``step_s`` is the mean time from one such end to the next, over the steps every rank reported
    after the first (warm-up, see :class:`RankClock`): the slowest rank's mean step time, which in a
    run whose collectives keep the ranks in step is every rank's. The slowest rank is the one whose
    step ended last most often (the critical path: the others wait for it in the collectives), and
    the compute, communication and exposed-communication split is its own.
    """

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    slowest_rank: int
    first_measured: int  # the measured steps, first to last
    last_step: int
    ranks: int  # ranks that reported steps
    ops: int  # over every rank and step
    bytes_only_ops: int


@dataclass(frozen=True)
class Segment:
    """A stretch of a rank's lane in emulated time: ``compute``, ``comm`` (a collective) or ``wait``."""

    start: float
    end: float
    kind: str
    coll: ClockedColl | None = None  # the collective of a ``comm`` segment


@dataclass(frozen=True)
class Lane:
    """One rank over the timeline's window: its steps there and its communicators' collectives."""

    rank: int
    steps: tuple[s.ClockedStep, ...]
    colls: tuple[ClockedColl, ...]  # by start

    def segments(self) -> list[Segment]:
        """The lane as compute, collectives and waits, in time order (see :func:`step_segments`)."""
        out: list[Segment] = []
        for step in self.steps:
            out += step_segments(step, self.colls)
        return out


def step_segments(step: s.ClockedStep, colls: tuple[ClockedColl, ...] | list[ClockedColl]) -> list[Segment]:
    """One step of one rank as compute, collectives and waits.

    The collectives' places are known (``coll_completed``'s emulated start and end); of compute only
    the step's total is, so it is placed: the compute no collective overlapped (``compute_s`` less the
    overlapped communication, ``comm_s - exposed_comm_s``) fills the time between collectives from the
    start of each gap, the gap after the step's last collective first (the optimizer's update runs
    there), the others in time order; what is left of a gap is the rank waiting for the collective
    that follows it, which starts only once its slowest member is ready.
    """
    a, b = step.t_start, step.t_end
    inside = sorted((c for c in colls if c.end > a and c.start < b), key=lambda c: (c.start, c.end))
    out = [Segment(max(c.start, a), min(c.end, b), "comm", c) for c in inside]
    gaps: list[tuple[float, float]] = []
    t = a
    for c in inside:
        if c.start > t:
            gaps.append((t, c.start))
        t = max(t, c.end)
    if b > t:
        gaps.append((t, b))
    budget = max(0.0, step.compute_s - max(0.0, step.comm_s - step.exposed_comm_s))
    if gaps and inside and gaps[-1][1] == b and gaps[-1][0] >= inside[-1].end:
        order = [gaps[-1], *gaps[:-1]]  # after the last collective: the optimizer's compute
    else:
        order = gaps
    for g0, g1 in order:
        used = min(budget, g1 - g0)
        budget -= used
        if used > 0:
            out.append(Segment(g0, g0 + used, "compute"))
        if g0 + used < g1:
            out.append(Segment(g0 + used, g1, "wait"))
    return sorted(out, key=lambda seg: (seg.start, seg.end))


@dataclass(frozen=True)
class Timeline:
    """The last few steps every rank reported, one lane per rank, in emulated seconds ``t0`` to ``t1``."""

    t0: float
    t1: float
    first_step: int
    last_step: int
    lanes: dict[int, Lane]  # by rank
    comms: tuple[str, ...]  # the communicators drawn, in the order they first appeared in the run



def rank_clock(rank: int, steps: list[s.ClockedStep], node: int | None) -> RankClock | None:
    """``rank``'s step figures, averaged over every step after the first (see :class:`RankClock`);
    ``node`` is the one it registered on (None: the one its last step names)."""
    if not steps:
        return None
    measured = steps[1:] if len(steps) > 1 else steps
    n = len(measured)
    return RankClock(
        rank=rank,
        node=steps[-1].node if node is None else node,
        steps=len(steps),
        measured=n,
        first_measured=measured[0].step,
        last_step=steps[-1].step,
        step_s=sum(x.t_end - x.t_start for x in measured) / n,
        last_step_s=steps[-1].t_end - steps[-1].t_start,
        compute_s=sum(x.compute_s for x in measured) / n,
        comm_s=sum(x.comm_s for x in measured) / n,
        exposed_comm_s=sum(x.exposed_comm_s for x in measured) / n,
        ops=sum(x.ops for x in steps),
        bytes_only_ops=sum(x.bytes_only_ops for x in steps),
    )


def predict(clocked_steps: Mapping[int, list[s.ClockedStep]], clocks: Mapping[int, RankClock]) -> Prediction | None:
    """The run's predicted step time from every rank's steps and figures (see :class:`Prediction`)."""
    if not clocks:
        return None
    by_step = {rank: {x.step: x for x in steps} for rank, steps in clocked_steps.items() if steps}
    common = sorted(set.intersection(*(set(steps) for steps in by_step.values())))
    # a step of the run ends when its last rank's does: from one such end to the next, after the first
    measured = [k for k in common if k - 1 in common] or common[-1:]
    times, last_ends = [], []
    for k in measured:
        ends = {rank: steps[k].t_end for rank, steps in by_step.items()}
        if k - 1 in common:
            times.append(max(ends.values()) - max(steps[k - 1].t_end for steps in by_step.values()))
        else:  # only one step: its longest
            times.append(max(steps[k].t_end - steps[k].t_start for steps in by_step.values()))
        last_ends.append(max(ends, key=lambda r: (ends[r], -r)))
    if not measured:  # the ranks reported no step number in common: the slowest rank's own mean
        slow = max(clocks.values(), key=lambda c: (c.step_s, -c.rank))
        step_s, first, last = slow.step_s, slow.first_measured, slow.last_step
    else:
        # the critical rank: the one whose step ended last most often (a tie: the longer mean, the lower rank)
        slow = max(clocks.values(), key=lambda c: (last_ends.count(c.rank), c.step_s, -c.rank))
        step_s, first, last = sum(times) / len(times), measured[0], measured[-1]
    return Prediction(
        step_s=step_s, compute_s=slow.compute_s, comm_s=slow.comm_s, exposed_comm_s=slow.exposed_comm_s,
        slowest_rank=slow.rank, first_measured=first, last_step=last, ranks=len(clocks),
        ops=sum(c.ops for c in clocks.values()), bytes_only_ops=sum(c.bytes_only_ops for c in clocks.values()),
    )


def timeline(clocked_steps: Mapping[int, list[s.ClockedStep]], members: Mapping[str, Collection[int]],
             clocked_colls: Mapping[str, Collection[ClockedColl]], steps: int = 3) -> Timeline | None:
    """The last ``steps`` steps that every rank reported, one lane per rank; None before there is one.

    ``members`` holds each communicator's global ranks, in the order the communicators first appeared.
    """
    reported = {rank: rs for rank, rs in sorted(clocked_steps.items()) if rs}
    if not reported or steps < 1:
        return None
    last = min(rs[-1].step for rs in reported.values())  # a live run's ranks are not all at the same step
    first = max(1, last - steps + 1)
    window = {rank: steps_between(rs, first, last) for rank, rs in reported.items()}
    times = [x for rs in window.values() for x in rs]
    if not times:
        return None
    t0, t1 = min(x.t_start for x in times), max(x.t_end for x in times)
    comms: list[str] = []
    lanes = {}
    for rank, rs in window.items():
        colls: list[ClockedColl] = []
        for comm, ranks in members.items():
            if rank not in ranks:
                continue
            mine = [c for c in clocked_colls.get(comm, ()) if c.end > t0 and c.start < t1]
            if mine and comm not in comms:
                comms.append(comm)
            colls += mine
        lanes[rank] = Lane(rank, rs, tuple(sorted(colls, key=lambda c: (c.start, c.end))))
    order = list(members)
    return Timeline(t0, t1, first, last, lanes, tuple(sorted(comms, key=order.index)))


def clocked_json(profile: str, p: Prediction | None, clocks: Mapping[int, RankClock],
                 clocked_steps: Mapping[int, list[s.ClockedStep]]) -> dict:
    """The clocked part of the run's JSON report: the prediction, then every rank's figures and steps."""
    return {
        "profile": profile,
        "measured_steps": "every step after the first (the first is warm-up); the only one if just one",
        "predicted_step_s": None if p is None else p.step_s,
        "compute_s": None if p is None else p.compute_s,
        "comm_s": None if p is None else p.comm_s,
        "exposed_comm_s": None if p is None else p.exposed_comm_s,
        "slowest_rank": None if p is None else p.slowest_rank,
        "ops": 0 if p is None else p.ops,
        "bytes_only_ops": 0 if p is None else p.bytes_only_ops,
        "ranks": {
            str(c.rank): {
                "node": c.node, "steps": c.steps, "measured_steps": c.measured, "mean_step_s": c.step_s,
                "last_step_s": c.last_step_s, "compute_s": c.compute_s, "comm_s": c.comm_s,
                "exposed_comm_s": c.exposed_comm_s, "ops": c.ops, "bytes_only_ops": c.bytes_only_ops,
                "per_step": [
                    {"step": x.step, "t_start": x.t_start, "t_end": x.t_end, "step_s": x.t_end - x.t_start,
                     "compute_s": x.compute_s, "comm_s": x.comm_s, "exposed_comm_s": x.exposed_comm_s,
                     "ops": x.ops, "bytes_only_ops": x.bytes_only_ops}
                    for x in clocked_steps[c.rank]
                ],
            }
            for c in clocks.values()
        },
    }


def steps_between(steps: list[s.ClockedStep], first: int, last: int) -> tuple[s.ClockedStep, ...]:
    """The steps numbered ``first`` to ``last`` of a rank's (in order): read from the end, the newest first."""
    out = []
    for x in reversed(steps):
        if x.step < first:
            break
        if x.step <= last:
            out.append(x)
    return tuple(reversed(out))

