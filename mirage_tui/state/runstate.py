"""The state of a run, folded from its event stream: ranks, nodes, communicators, memory, traffic, findings,
and in clocked mode every rank's steps and collectives in emulated time.

One fold serves every reader: ``mirage status`` (from ``events.jsonl``, live or
after the fact), the session (hang diagnoses, the failure summary, the run's
JSON report), and the console, live or replayed (the rank tree, the ledger grid,
GPU memory, collectives in flight, the clocked timeline, the Report screen). Nothing here talks to a
process or draws: feed it events with :meth:`RunState.apply`, read its fields
and tables. Each reader folds into its own instance on its own thread (the
session on its dispatcher, the console on its UI thread). What clocked mode derives
from its steps (figures, prediction, timeline) is computed in :mod:`mirage_tui.state.clocked`.

Up to 650 lines on purpose: the fold is one table of small handlers, one per
event, over the one state they share; what clocked mode derives lives beside it.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from mirage_tui.glyphs import human_bytes
from mirage_tui.state import clocked as runstate_clocked
from mirage_tui.state.clocked import CLOCKED_COLLECTIVES, ClockedColl, Prediction, RankClock, Timeline
from mirage_tui.state.traffic import Traffic
from wire import schema as s

#: Samples of allocated bytes kept per (rank, GPU): the console draws them as a sparkline in a narrow pane.
MEMORY_HISTORY = 10
_TRACEBACK = "Traceback (most recent call last)"


def read_journal(path: str) -> Iterator[s.Event]:
    """The events of an ``events.jsonl``; a line cut short by a live writer is skipped."""
    with open(path, "rb") as f:
        for event, _ in s.iter_events(f):
            yield event


class Changed(enum.Flag):
    """What an event changed, so that a display redraws only that."""

    NOTHING = 0
    RANKS = enum.auto()  # nodes, ranks, their states or GPUs
    LEDGER = enum.auto()  # a communicator's positions
    MEMORY = enum.auto()
    TRAFFIC = enum.auto()  # collectives in flight, throughput
    CLOCK = enum.auto()  # clocked mode: a rank's step, or a collective's place in emulated time


@dataclass(frozen=True)
class Outcome:
    """How a run ended: the session's exit code and one-line summary (the journal's ``session_ended``)."""

    returncode: int
    summary: str
    run_dir: str


@dataclass
class RankColl:
    """One rank's position in one communicator."""

    last_enqueued: int = 0
    last_started: int = 0
    last_completed: int = 0
    op: str = ""
    numel: int = 0
    dtype: str = ""
    site: str = ""
    enqueued_at: float = 0.0


@dataclass(slots=True)
class Arrivals:
    """The ranks that posted one collective so far: when, relative to the first, and who came last."""

    first_t: float
    after_first_s: float = 0.0  # summed over the ranks: how long after the first each posted
    ranks: int = 1
    last_t: float = 0.0
    last_rank: int = 0


#: Point-to-point messages are numbered per pair of ranks, not per communicator: their arrivals are not
#: a collective's, so they count towards neither waiting time nor the slowest rank.
_P2P = (s.CollOp.SEND, s.CollOp.RECV)


@dataclass
class CommState:
    """One communicator: who is in it, where each rank is in its ledger, and what it carried so far."""

    comm: str
    size: int
    transport: str = "shm"
    name: str = ""  # torch's group_name ("" in a journal recorded before ranks sent it)
    desc: str = ""  # torch's group_desc: "default_pg", "mesh_tp", a new_group's, "undefined"
    ranks: dict[int, RankColl] = field(default_factory=dict)  # global rank -> position
    global_of: dict[int, int] = field(default_factory=dict)  # communicator rank -> global rank
    failed: str = ""
    bytes_done: int = 0  # coll_completed's total_bytes, summed
    collectives: int = 0  # completed (point-to-point messages included)
    # summed over its ranks and collectives: the time from a rank's post (coll_enqueued) to the
    # collective's start (coll_started), i.e. how long ranks waited for the last one to arrive
    wait_s: float = 0.0
    last_arrivals: dict[int, int] = field(default_factory=dict)  # global rank -> collectives it posted last
    arriving: dict[int, Arrivals] = field(default_factory=dict)  # seq -> its posts so far, until it starts

    @property
    def base_name(self) -> str:
        """torch's name for it: its description; ``group <name>`` for one without (torch's "undefined");
        the first characters of its id in a journal that does not name it."""
        if self.desc and self.desc != "undefined":
            return self.desc
        if self.name:
            return f"group {self.name[:8]}"
        return self.comm[:8]

    @property
    def title(self) -> str:
        """Its name with its id's first characters, as the report and ``mirage status`` head it."""
        base = self.base_name
        return base if base == self.comm[:8] else f"{base} ({self.comm[:8]})"

    @property
    def slowest_rank(self) -> int | None:
        """The global rank that posted last most often (a tie: the lowest); None before any collective started."""
        if not self.last_arrivals:
            return None
        return max(sorted(self.last_arrivals), key=self.last_arrivals.__getitem__)


@dataclass
class RankStatus:
    """One rank as its events tell it: where it runs, the GPUs it used, how it is doing or how it ended.

    Made at the first event that names the rank: a hang can name a rank that has
    not registered yet, and the tree shows that once it does.
    """

    node: int | None = None  # from its first registration; None until it registers
    pid: int = 0  # of its first registration (RunState.rank_pids keeps the latest, the live process)
    registered_at: float | None = None
    ended_at: float | None = None  # seen gone, or its node process exited
    # no event carries a torchrun worker's exit code: these are what is known of how it ended
    exited_ok: bool = False  # its node process exited 0 (torchrun only does if every worker did)
    raised: bool = False  # a traceback on its stderr
    failed: bool = False  # raised and ended, killed from the console, or (launched directly) exited non-zero
    hung: str = ""  # "stuck" (waits in a reported hang) or "missing" (a hang waits for it)
    host: str = ""  # the machine it registered from (several hosts: --launcher slurm)
    gpus: set[int] = field(default_factory=set)  # the node's GPU indices it used
    peak_memory: int = 0  # bytes: the largest allocation peak any of its GPUs reported
    compiling: bool = False  # inside a torch.compile compilation (dynamo to inductor)


@dataclass
class Finding:
    """One thing that went wrong: ``kind`` is hang, desync, dead peer, comm failure or straggler."""

    kind: str
    text: str


def classify_comm_failure(code: str, message: str) -> str:
    """Name what a ``comm_failed`` event means for the user."""
    if code == "ncclRemoteError":
        return "dead peer"
    if "mismatch" in message:
        return "desync"
    return "comm failure"



@dataclass
class RunState:
    """The fold; feed it every event with :meth:`apply`.

    Ranks are global ranks. :attr:`ranks` holds every rank an event named,
    :attr:`registered` those that registered (the ones the tree and the report show).
    """

    comms: dict[str, CommState] = field(default_factory=dict)
    ranks: dict[int, RankStatus] = field(default_factory=dict)
    rank_pids: dict[int, int] = field(default_factory=dict)  # the latest registration's pid
    #: the pid each rank's launcher started (its fork server stub, else the rank's own): the latest registration's
    launched_pids: dict[int, int] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)  # in the order the daemon noticed them
    nodes: int = 0  # as the daemon announced them
    node_exits: dict[int, int] = field(default_factory=dict)
    hangs: list[s.HangDetected] = field(default_factory=list)
    hang_reports: list[s.HangReport] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    memory: dict[tuple[int, int], s.MemoryUsage] = field(default_factory=dict)  # (rank, node GPU) -> latest
    memory_history: dict[tuple[int, int], deque[int]] = field(default_factory=dict)  # allocated, oldest first
    traffic: Traffic = field(default_factory=Traffic)
    last_output: dict[int, tuple[str, float]] = field(default_factory=dict)  # rank -> (line, when)
    started_at: float | None = None  # the daemon came up (a run without one has no start here)
    ended: s.SessionEnded | None = None
    last_t: float = 0.0
    events: int = 0
    exec_mode: str = "functional"  # as the daemon announced it: "functional", "clocked" or "estimate"
    profile: str = ""  # as the daemon announced it
    clocked_steps: dict[int, list[s.ClockedStep]] = field(default_factory=dict)  # rank -> steps, in order
    clocked_colls: dict[str, deque[ClockedColl]] = field(default_factory=dict)  # comm -> the latest
    _named: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)  # name -> comms
    _prediction: tuple[int, Prediction | None] = field(default=(-1, None), init=False, repr=False, compare=False)

    def apply(self, e: s.Event) -> Changed:
        """Fold one event in; return what it changed."""
        self.events += 1
        self.last_t = max(self.last_t, e.t)
        fold = _FOLDS.get(type(e))
        return Changed.NOTHING if fold is None else fold(self, e)

    def _rank(self, rank: int) -> RankStatus:
        status = self.ranks.get(rank)
        if status is None:
            status = self.ranks[rank] = RankStatus()
        return status

    def _output(self, e: s.OutputLine) -> Changed:
        if e.rank >= 0:
            self.last_output[e.rank] = (e.text, e.t)
            # anywhere in the line: torch prefixes a rank's stderr lines with "[rankN]: "
            if e.stream is s.Stream.STDERR and _TRACEBACK in e.text:
                self._rank(e.rank).raised = True
        return Changed.NOTHING

    def _daemon_ready(self, e: s.DaemonReady) -> Changed:
        if self.started_at is None:
            self.started_at = e.t
        self.nodes = max(self.nodes, e.nodes)
        self.exec_mode, self.profile = e.exec_mode, e.profile
        return Changed.RANKS | (Changed.CLOCK if e.exec_mode != "functional" else Changed.NOTHING)

    def _registered(self, e: s.RankRegistered) -> Changed:
        self.rank_pids[e.rank] = e.pid
        self.launched_pids[e.rank] = e.launched_pid or e.pid
        status = self._rank(e.rank)
        if status.node is None:  # a launcher's child that claims the rank later keeps its parent's place
            status.node, status.pid, status.registered_at = e.node, e.pid, e.t
        status.host = e.host
        return Changed.RANKS

    def _gone(self, e: s.RankGone) -> Changed:
        self.gone.append(e.rank)
        status = self._rank(e.rank)
        if status.ended_at is None:
            status.ended_at = e.t
        if status.raised:
            status.failed = True
        return Changed.RANKS

    def _compiling(self, e: s.RankCompiling) -> Changed:
        self._rank(e.rank).compiling = e.compiling
        return Changed.RANKS

    def _joined(self, e: s.CommJoined) -> Changed:
        c = self.comms.get(e.comm)
        if c is None:
            c = self.comms[e.comm] = CommState(e.comm, e.size, e.transport, e.name, e.desc)
            self._named[c.base_name] = self._named.get(c.base_name, 0) + 1
        c.global_of[e.rank] = e.global_rank
        c.ranks.setdefault(e.global_rank, RankColl())
        return Changed.LEDGER | Changed.RANKS

    def _enqueued(self, e: s.CollectiveEnqueued) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            # the event names the communicator's rank; positions and statuses are by global rank
            rank = c.global_of.get(e.rank, e.rank)
            pos = c.ranks.setdefault(rank, RankColl())
            pos.last_enqueued, pos.op, pos.numel, pos.dtype = e.seq, e.op.name, e.numel, e.dtype
            pos.site, pos.enqueued_at = e.site, e.t
            self._rank(rank).gpus.add(e.device)
            if e.op not in _P2P:
                a = c.arriving.get(e.seq)
                if a is None:
                    c.arriving[e.seq] = Arrivals(e.t, 0.0, 1, e.t, rank)
                else:
                    a.after_first_s += e.t - a.first_t
                    a.ranks += 1
                    if e.t >= a.last_t:  # the same instant: the daemon's order decides
                        a.last_t, a.last_rank = e.t, rank
        return Changed.LEDGER | Changed.RANKS

    def _started(self, e: s.CollectiveStarted) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            for pos in c.ranks.values():
                pos.last_started = max(pos.last_started, e.seq)
            a = c.arriving.pop(e.seq, None) if e.op not in _P2P else None
            if a is not None:
                # every rank waited from its post to this start: ranks x (start - first post) - the posts' lag
                c.wait_s += max(0.0, a.ranks * (e.t - a.first_t) - a.after_first_s)
                if c.size > 1:
                    c.last_arrivals[a.last_rank] = c.last_arrivals.get(a.last_rank, 0) + 1
        return Changed.LEDGER | Changed.RANKS | self._traffic(e)

    def _completed(self, e: s.CollectiveCompleted) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            for pos in c.ranks.values():
                pos.last_completed = max(pos.last_completed, e.seq)
            c.bytes_done += e.total_bytes
            c.collectives += 1
        changed = Changed.LEDGER | Changed.RANKS | self._traffic(e)
        if e.emulated_end > 0:  # clocked mode: its place in emulated time
            colls = self.clocked_colls.setdefault(e.comm, deque(maxlen=CLOCKED_COLLECTIVES))
            colls.append(ClockedColl(e.comm, e.seq, e.op.name, e.emulated_start, e.emulated_end, e.algo,
                                     e.total_bytes))
            changed |= Changed.CLOCK
        return changed

    def _clocked_step(self, e: s.ClockedStep) -> Changed:
        self.clocked_steps.setdefault(e.rank, []).append(e)
        return Changed.CLOCK

    def _traffic(self, e: s.Event) -> Changed:
        return Changed.TRAFFIC if self.traffic.apply(e) else Changed.NOTHING

    def _comm_failed(self, e: s.CommFailed) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            c.failed = f"{e.code}: {e.message}"
        self.findings.append(Finding(classify_comm_failure(e.code, e.message),
                                     f"communicator {self.comm_label(e.comm)}: {e.code}: {e.message}"))
        return self._traffic(e)

    def _hang(self, e: s.HangDetected) -> Changed:
        self.hangs.append(e)
        self.findings.append(Finding(
            "hang", f"{e.waiting_for(self.comm_label(e.comm))}: missing ranks "
            f"{{{', '.join(map(str, e.missing))}}}, joined {{{', '.join(map(str, e.joined))}}}, "
            f"waited {e.waited_s:.1f} s"))
        for rank in e.joined:
            self._rank(rank).hung = "stuck"
        for rank in e.missing:
            self._rank(rank).hung = "missing"
        return Changed.RANKS

    def _host_lost(self, e: s.HostLost) -> Changed:
        ranks = ", ".join(map(str, e.ranks)) or "none registered"
        self.findings.append(Finding(
            "host lost", f"host {e.host} ({e.why}): node(s) {', '.join(map(str, e.nodes))}, ranks {{{ranks}}}"))
        for rank in e.ranks:
            status = self._rank(rank)
            status.failed = True
            if status.ended_at is None:
                status.ended_at = e.t
        return Changed.RANKS

    def _hang_report(self, e: s.HangReport) -> Changed:
        self.hang_reports.append(e)
        return Changed.NOTHING

    def _straggler(self, e: s.StragglerWarning) -> Changed:
        self.findings.append(Finding(
            "straggler", f"rank {e.rank} arrived last at {e.count} collectives in a row of {self.comm_label(e.comm)}, "
            f"{e.mean_margin_s:.2f} s behind on average"))
        return Changed.NOTHING

    def _memory(self, e: s.MemoryUsage) -> Changed:
        key = (e.rank, e.device)
        self.memory[key] = e
        self.memory_history.setdefault(key, deque(maxlen=MEMORY_HISTORY)).append(e.allocated)
        status = self._rank(e.rank)
        status.gpus.add(e.device)
        # the peak as reported, or what is allocated now if the program reset its peak since
        status.peak_memory = max(status.peak_memory, e.peak, e.allocated)
        return Changed.MEMORY | Changed.RANKS

    def _process_exited(self, e: s.ProcessExited) -> Changed:
        self.node_exits[e.node] = e.returncode
        for rank, status in self.ranks.items():
            if status.node != e.node:
                continue
            if status.ended_at is None:
                status.ended_at = e.t
            if e.returncode == 0:
                status.exited_ok = True
                status.failed = False  # a traceback it printed and handled
            elif status.raised or self.launched_pids.get(rank) == e.pid:
                status.failed = True  # launched directly, the node process is the rank: its code is the rank's
        return Changed.RANKS

    def _session_ended(self, e: s.SessionEnded) -> Changed:
        self.ended = e
        return Changed.NOTHING

    def comm_label(self, comm: str) -> str:
        """How every reader names communicator ``comm``: torch's name for it (see :attr:`CommState.base_name`),
        with its id's first characters where another communicator has the same name (``mesh_tp (794f54dd)``)."""
        c = self.comms.get(comm)
        if c is None:
            return comm[:8]
        return c.title if self._named.get(c.base_name, 0) > 1 else c.base_name

    def rank_killed(self, rank: int) -> None:
        """The console killed ``rank``'s process: it failed, whatever its node's exit code says later."""
        self._rank(rank).failed = True

    def rank_state(self, rank: int) -> str:
        """running, compiling, in collective, stuck, missing; then exited 0, failed, or exited (its exit code
        unknown)."""
        word = self.settled_state(rank)
        if word:
            return word
        if self.ranks.get(rank, _UNKNOWN).compiling:
            return "compiling"
        for comm in self.comms.values():
            pos = comm.ranks.get(rank)
            if pos is not None and pos.last_enqueued > pos.last_completed:
                return "in collective"
        return "running"

    def settled_state(self, rank: int) -> str:
        """What no collective changes: failed, exited 0, exited, then stuck or missing (a reported hang);
        "" while the rank runs (:meth:`rank_state` then asks its communicators)."""
        status = self.ranks.get(rank, _UNKNOWN)
        if status.failed:
            return "failed"
        if status.ended_at is not None:
            return "exited 0" if status.exited_ok else "exited"
        return status.hung

    def node_host(self, node: int) -> str:
        """The host node ``node``'s ranks registered from, when the run spans several hosts; else ""."""
        hosts = {r.host for r in self.ranks.values() if r.host}
        if len(hosts) < 2:
            return ""
        return next((r.host for r in self.ranks.values() if r.node == node and r.host), "")

    def node_state(self, node: int) -> str:
        """``exit N`` once its process ended, ``starting`` until one of its ranks registers, else empty."""
        code = self.node_exits.get(node)
        if code is not None:
            return f"exit {code}"
        if not any(status.node == node for status in self.ranks.values()):
            return "starting"
        return ""

    @property
    def registered(self) -> dict[int, RankStatus]:
        """The ranks that registered, by rank."""
        return {rank: status for rank, status in sorted(self.ranks.items()) if status.node is not None}

    @property
    def began_at(self) -> float | None:
        """When the run began: the daemon came up, or (a run without one) its first rank registered."""
        times = [status.registered_at for status in self.ranks.values() if status.registered_at is not None]
        if self.started_at is not None:
            times.append(self.started_at)
        return min(times, default=None)

    @classmethod
    def from_journal(cls, path: str) -> RunState:
        """Fold a run's ``events.jsonl`` (a line cut short by a live writer is skipped)."""
        state = cls()
        for event in read_journal(path):
            state.apply(event)
        return state

    # ------------------------------------------------------------ clocked mode

    @property
    def clocked(self) -> bool:
        """Whether the run keeps emulated time (the daemon said so, or a rank reported a step)."""
        return self.exec_mode != "functional" or bool(self.clocked_steps)

    def rank_clock(self, rank: int) -> RankClock | None:
        """``rank``'s step figures, averaged over every step after the first (see :class:`RankClock`)."""
        status = self.ranks.get(rank)
        node = None if status is None else status.node
        return runstate_clocked.rank_clock(rank, self.clocked_steps.get(rank, []), node)

    def rank_clocks(self) -> dict[int, RankClock]:
        """Every rank's step figures that reported a step, by rank."""
        out = {}
        for rank in sorted(self.clocked_steps):
            clock = self.rank_clock(rank)
            if clock is not None:
                out[rank] = clock
        return out

    def prediction(self) -> Prediction | None:
        """The run's predicted step time, or None before any step was reported (see :class:`Prediction`)."""
        steps = sum(map(len, self.clocked_steps.values()))  # steps only ever arrive: the count dates it
        if self._prediction[0] != steps:
            self._prediction = (steps, runstate_clocked.predict(self.clocked_steps, self.rank_clocks()))
        return self._prediction[1]

    def timeline(self, steps: int = 3) -> Timeline | None:
        """The last ``steps`` steps that every rank reported, one lane per rank; None before there is one."""
        members = {comm: state.ranks for comm, state in self.comms.items()}
        return runstate_clocked.timeline(self.clocked_steps, members, self.clocked_colls, steps)

    def clocked_json(self) -> dict:
        """The clocked part of the run's JSON report: the prediction, then every rank's figures and steps."""
        return runstate_clocked.clocked_json(self.profile, self.prediction(), self.rank_clocks(), self.clocked_steps)

    def ledger_table(self, now: float | None = None) -> str:
        """Per communicator and rank: last enqueued / started / completed, with op, size, age and call site."""
        now = self.last_t if now is None else now
        out = []
        for c in self.comms.values():
            head = f"communicator {c.title}: {c.size} ranks, {c.transport}"
            out.append(head + (f", FAILED ({c.failed})" if c.failed else ""))
            out.append(f"  {'rank':>4}  {'enqueued':>8}  {'started':>7}  {'completed':>9}  {'op':<14} "
                       f"{'numel':>10} {'dtype':<8} {'age':>7}  call site")
            for rank in sorted(c.ranks):
                p = c.ranks[rank]
                age = f"{now - p.enqueued_at:6.1f}s" if p.enqueued_at else ""
                waiting = " *" if p.last_enqueued > p.last_completed else ""
                out.append(
                    f"  {rank:>4}  {'#' + str(p.last_enqueued):>8}  {'#' + str(p.last_started):>7}  "
                    f"{'#' + str(p.last_completed):>9}  {p.op:<14} {p.numel:>10} {p.dtype:<8} {age:>7}  "
                    f"{p.site}{waiting}"
                )
        if not out:
            return "no communicators yet"
        return "\n".join(out) + "\n  (* waiting for a collective to complete)"

    def memory_table(self) -> str:
        """Per rank and GPU: memory allocated, reserved and its peak, as the ranks last reported."""
        if not self.memory:
            return "no GPU memory reported yet"
        out = [f"  {'rank':>4}  {'gpu':>3}  {'allocated':>10}  {'reserved':>10}  {'peak':>10}  {'total':>10}"]
        for (rank, device), m in sorted(self.memory.items()):
            out.append(f"  {rank:>4}  {device:>3}  {human_bytes(m.allocated):>10}  {human_bytes(m.reserved):>10}  "
                       f"{human_bytes(m.peak):>10}  {human_bytes(m.total):>10}")
        return "GPU memory\n" + "\n".join(out)

    def memory_json(self) -> dict:
        """The GPU-memory part of the run's JSON report: ``{rank: {gpu: figures}}``."""
        out: dict = {}
        for (rank, device), m in sorted(self.memory.items()):
            out.setdefault(str(rank), {})[str(device)] = {
                "allocated": m.allocated, "reserved": m.reserved, "peak": m.peak, "total": m.total,
            }
        return out

    def to_json(self) -> dict:
        """The per-communicator part of the run's JSON report: identity, what it carried, every rank's position."""
        return {
            c.comm: {
                "name": c.name or None,
                "desc": c.desc or None,
                "label": self.comm_label(c.comm),
                "size": c.size,
                "transport": c.transport,
                "failed": c.failed or None,
                "collectives": c.collectives,
                "bytes": c.bytes_done,
                "wait_s": round(c.wait_s, 6),
                "slowest_rank": c.slowest_rank,
                "last_arrivals": {str(r): n for r, n in sorted(c.last_arrivals.items())},
                "ranks": {
                    str(r): {
                        "last_enqueued": p.last_enqueued,
                        "last_started": p.last_started,
                        "last_completed": p.last_completed,
                        "op": p.op,
                        "numel": p.numel,
                        "dtype": p.dtype,
                        "site": p.site,
                    }
                    for r, p in sorted(c.ranks.items())
                },
            }
            for c in self.comms.values()
        }


_UNKNOWN = RankStatus()  # what is known of a rank no event named yet: nothing

#: The fold of each event type; events of other types only count and move the clock.
_FOLDS: dict[type, Callable[[RunState, s.Event], Changed]] = {
    s.OutputLine: RunState._output,
    s.DaemonReady: RunState._daemon_ready,
    s.RankRegistered: RunState._registered,
    s.HostLost: RunState._host_lost,
    s.RankGone: RunState._gone,
    s.RankCompiling: RunState._compiling,
    s.CommJoined: RunState._joined,
    s.CollectiveEnqueued: RunState._enqueued,
    s.CollectiveStarted: RunState._started,
    s.CollectiveProgress: RunState._traffic,
    s.CollectiveCompleted: RunState._completed,
    s.CommFailed: RunState._comm_failed,
    s.HangDetected: RunState._hang,
    s.HangReport: RunState._hang_report,
    s.StragglerWarning: RunState._straggler,
    s.MemoryUsage: RunState._memory,
    s.ClockedStep: RunState._clocked_step,
    s.ProcessExited: RunState._process_exited,
    s.SessionEnded: RunState._session_ended,
}
