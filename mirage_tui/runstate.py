"""The state of a run, folded from its event stream: ranks, nodes, communicators, memory, traffic, findings.

One fold serves every reader: ``mirage status`` (from ``events.jsonl``, live or
after the fact), the session (hang diagnoses, the failure summary, the run's
JSON report), and the console, live or replayed (the rank tree, the ledger grid,
GPU memory, collectives in flight, the Report screen). Nothing here talks to a
process or draws: feed it events with :meth:`RunState.apply`, read its fields
and tables. Each reader folds into its own instance on its own thread (the
session on its dispatcher, the console on its UI thread).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from emulator import schema as s
from mirage_tui.glyphs import human_bytes
from mirage_tui.traffic import Traffic

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


@dataclass
class CommState:
    comm: str
    size: int
    transport: str = "shm"
    ranks: dict[int, RankColl] = field(default_factory=dict)  # global rank -> position
    global_of: dict[int, int] = field(default_factory=dict)  # communicator rank -> global rank
    failed: str = ""
    bytes_done: int = 0


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
    gpus: set[int] = field(default_factory=set)  # the node's GPU indices it used


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
        return Changed.RANKS

    def _registered(self, e: s.RankRegistered) -> Changed:
        self.rank_pids[e.rank] = e.pid
        status = self._rank(e.rank)
        if status.node is None:  # a launcher's child that claims the rank later keeps its parent's place
            status.node, status.pid, status.registered_at = e.node, e.pid, e.t
        return Changed.RANKS

    def _gone(self, e: s.RankGone) -> Changed:
        self.gone.append(e.rank)
        status = self._rank(e.rank)
        if status.ended_at is None:
            status.ended_at = e.t
        if status.raised:
            status.failed = True
        return Changed.RANKS

    def _joined(self, e: s.CommJoined) -> Changed:
        c = self.comms.setdefault(e.comm, CommState(e.comm, e.size, e.transport))
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
        return Changed.LEDGER | Changed.RANKS

    def _started(self, e: s.CollectiveStarted) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            for pos in c.ranks.values():
                pos.last_started = max(pos.last_started, e.seq)
        return Changed.LEDGER | Changed.RANKS | self._traffic(e)

    def _completed(self, e: s.CollectiveCompleted) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            for pos in c.ranks.values():
                pos.last_completed = max(pos.last_completed, e.seq)
            c.bytes_done += e.total_bytes
        return Changed.LEDGER | Changed.RANKS | self._traffic(e)

    def _traffic(self, e: s.Event) -> Changed:
        return Changed.TRAFFIC if self.traffic.apply(e) else Changed.NOTHING

    def _comm_failed(self, e: s.CommFailed) -> Changed:
        c = self.comms.get(e.comm)
        if c is not None:
            c.failed = f"{e.code}: {e.message}"
        self.findings.append(Finding(classify_comm_failure(e.code, e.message),
                                     f"communicator {e.comm[:8]}: {e.code}: {e.message}"))
        return self._traffic(e)

    def _hang(self, e: s.HangDetected) -> Changed:
        self.hangs.append(e)
        self.findings.append(Finding(
            "hang", f"{e.waiting_for()}: missing ranks "
            f"{{{', '.join(map(str, e.missing))}}}, joined {{{', '.join(map(str, e.joined))}}}, "
            f"waited {e.waited_s:.1f} s"))
        for rank in e.joined:
            self._rank(rank).hung = "stuck"
        for rank in e.missing:
            self._rank(rank).hung = "missing"
        return Changed.RANKS

    def _hang_report(self, e: s.HangReport) -> Changed:
        self.hang_reports.append(e)
        return Changed.NOTHING

    def _straggler(self, e: s.StragglerWarning) -> Changed:
        self.findings.append(Finding(
            "straggler", f"rank {e.rank} arrived last at {e.count} collectives in a row of {e.comm[:8]}, "
            f"{e.mean_margin_s:.2f} s behind on average"))
        return Changed.NOTHING

    def _memory(self, e: s.MemoryUsage) -> Changed:
        key = (e.rank, e.device)
        self.memory[key] = e
        self.memory_history.setdefault(key, deque(maxlen=MEMORY_HISTORY)).append(e.allocated)
        self._rank(e.rank).gpus.add(e.device)
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
            elif status.raised or self.rank_pids.get(rank) == e.pid:
                status.failed = True  # launched directly, the node process is the rank: its code is the rank's
        return Changed.RANKS

    def _session_ended(self, e: s.SessionEnded) -> Changed:
        self.ended = e
        return Changed.NOTHING

    def rank_killed(self, rank: int) -> None:
        """The console killed ``rank``'s process: it failed, whatever its node's exit code says later."""
        self._rank(rank).failed = True

    def rank_state(self, rank: int) -> str:
        """running, in collective, stuck, missing; then exited 0, failed, or exited (its exit code unknown)."""
        status = self.ranks.get(rank, _UNKNOWN)
        if status.failed:
            return "failed"
        if status.ended_at is not None:
            return "exited 0" if status.exited_ok else "exited"
        if status.hung:
            return status.hung
        for comm in self.comms.values():
            pos = comm.ranks.get(rank)
            if pos is not None and pos.last_enqueued > pos.last_completed:
                return "in collective"
        return "running"

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

    def ledger_table(self, now: float | None = None) -> str:
        """Per communicator and rank: last enqueued / started / completed, with op, size, age and call site."""
        now = self.last_t if now is None else now
        out = []
        for c in self.comms.values():
            head = f"communicator {c.comm[:8]}: {c.size} ranks, {c.transport}"
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
        """The per-communicator part of the run's JSON report."""
        return {
            c.comm: {
                "size": c.size,
                "transport": c.transport,
                "failed": c.failed or None,
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
    s.RankGone: RunState._gone,
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
    s.ProcessExited: RunState._process_exited,
    s.SessionEnded: RunState._session_ended,
}
