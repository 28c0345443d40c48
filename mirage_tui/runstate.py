"""The state of a run, folded from its event stream.

One fold serves every reader: ``mirage status`` (from ``events.jsonl``, live or
after the fact), the run's JSON report, and the console. Nothing here talks to
a process: feed it events, read the tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from emulator import schema as s


def read_journal(path: str) -> Iterator[s.Event]:
    """The events of an ``events.jsonl``; a line cut short by a live writer is skipped."""
    with open(path, "rb") as f:
        for event, _ in s.iter_events(f):
            yield event


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``: sizes the way nvidia-smi/rocm-smi readers expect them."""
    if n < 1024:
        return f"{n} B"
    size, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            break
    return f"{size:.1f} {unit}"


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
class RunState:
    comms: dict[str, CommState] = field(default_factory=dict)
    rank_pids: dict[int, int] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)
    node_exits: dict[int, int] = field(default_factory=dict)
    hangs: list[s.HangDetected] = field(default_factory=list)
    memory: dict[tuple[int, int], s.MemoryUsage] = field(default_factory=dict)  # (rank, node GPU) -> latest
    started_at: float | None = None
    ended: s.SessionEnded | None = None
    last_t: float = 0.0

    def apply(self, e: s.Event) -> None:
        """Fold one event in."""
        self.last_t = max(self.last_t, e.t)
        if isinstance(e, s.DaemonReady) and self.started_at is None:
            self.started_at = e.t
        elif isinstance(e, s.RankRegistered):
            self.rank_pids[e.rank] = e.pid
        elif isinstance(e, s.RankGone):
            self.gone.append(e.rank)
        elif isinstance(e, s.CommJoined):
            c = self.comms.setdefault(e.comm, CommState(e.comm, e.size, e.transport))
            c.global_of[e.rank] = e.global_rank
            c.ranks.setdefault(e.global_rank, RankColl())
        elif isinstance(e, s.CollectiveEnqueued):
            c = self.comms.get(e.comm)
            if c is not None:
                pos = c.ranks.setdefault(c.global_of.get(e.rank, e.rank), RankColl())
                pos.last_enqueued, pos.op, pos.numel, pos.dtype = e.seq, e.op.name, e.numel, e.dtype
                pos.site, pos.enqueued_at = e.site, e.t
        elif isinstance(e, (s.CollectiveStarted, s.CollectiveCompleted)):
            c = self.comms.get(e.comm)
            if c is not None:
                for pos in c.ranks.values():
                    if isinstance(e, s.CollectiveStarted):
                        pos.last_started = max(pos.last_started, e.seq)
                    else:
                        pos.last_completed = max(pos.last_completed, e.seq)
                if isinstance(e, s.CollectiveCompleted):
                    c.bytes_done += e.total_bytes
        elif isinstance(e, s.CommFailed):
            c = self.comms.get(e.comm)
            if c is not None:
                c.failed = f"{e.code}: {e.message}"
        elif isinstance(e, s.HangDetected):
            self.hangs.append(e)
        elif isinstance(e, s.MemoryUsage):
            self.memory[(e.rank, e.device)] = e
        elif isinstance(e, s.ProcessExited):
            self.node_exits[e.node] = e.returncode
        elif isinstance(e, s.SessionEnded):
            self.ended = e

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
