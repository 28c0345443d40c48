"""What the Report screen shows, folded from a run's events: exits, durations, findings, log paths.

No Textual here: the fold is plain data so it can be checked against a journal
without an app, and the screen only lays it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from emulator import schema as s
from mirage_tui.rundir import RunDir
from mirage_tui.session import Outcome


@dataclass
class RankSpan:
    """When a rank registered and when it was seen gone (its node's exit counts)."""

    node: int
    pid: int
    started: float
    ended: float | None = None


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
class Summary:
    """The fold; feed it every event with :meth:`apply`."""

    started: float | None = None
    last_t: float = 0.0
    node_exits: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (code, when)
    ranks: dict[int, RankSpan] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    events: int = 0

    def apply(self, e: s.Event) -> None:
        """Fold one event in."""
        self.events += 1
        self.last_t = max(self.last_t, e.t)
        if isinstance(e, s.DaemonReady) and self.started is None:
            self.started = e.t
        elif isinstance(e, s.RankRegistered):
            self.ranks.setdefault(e.rank, RankSpan(e.node, e.pid, e.t))
            self.started = e.t if self.started is None else min(self.started, e.t)
        elif isinstance(e, s.RankGone):
            span = self.ranks.get(e.rank)
            if span is not None and span.ended is None:
                span.ended = e.t
        elif isinstance(e, s.ProcessExited):
            self.node_exits[e.node] = (e.returncode, e.t)
            for span in self.ranks.values():
                if span.node == e.node and span.ended is None:
                    span.ended = e.t
        elif isinstance(e, s.HangDetected):
            self.findings.append(Finding(
                "hang", f"{e.waiting_for()}: missing ranks "
                f"{{{', '.join(map(str, e.missing))}}}, joined {{{', '.join(map(str, e.joined))}}}, "
                f"waited {e.waited_s:.1f} s"))
        elif isinstance(e, s.CommFailed):
            self.findings.append(Finding(classify_comm_failure(e.code, e.message),
                                         f"communicator {e.comm[:8]}: {e.code}: {e.message}"))
        elif isinstance(e, s.StragglerWarning):
            self.findings.append(Finding(
                "straggler", f"rank {e.rank} arrived last at {e.count} collectives in a row of {e.comm[:8]}, "
                f"{e.mean_margin_s:.2f} s behind on average"))

    def render(self, outcome: Outcome, run_dir: str, skipped: int = 0) -> str:
        """The report as plain text lines (the screen adds colour)."""
        paths = RunDir(path=run_dir, session="", token="")  # only its path-naming rules are used
        status = "ok" if outcome.returncode == 0 else "FAILED"
        out = [f"run {status}: exit {outcome.returncode}", f"  {outcome.summary}"]
        if self.started is not None:
            out.append(f"  duration {self.last_t - self.started:.1f} s, {self.events} events")
        out.append(f"  run dir: {run_dir}")
        out += ["", "nodes"]
        for node, (code, _) in sorted(self.node_exits.items()):
            out.append(f"  node {node}  exit {code:<4} log {paths.node_log(node)}")
        if not self.node_exits:
            out.append("  (no node process exited)")
        out += ["", "ranks"]
        for rank, span in sorted(self.ranks.items()):
            ran = f"{span.ended - span.started:6.1f} s" if span.ended is not None else "  (no end)"
            out.append(f"  rank {rank}  node {span.node}  pid {span.pid:<7} ran {ran}  log {paths.rank_log(rank)}")
        if not self.ranks:
            out.append("  (no rank registered)")
        out += ["", "findings"]
        out += [f"  {f.kind}: {f.text}" for f in self.findings] or ["  none"]
        if skipped:
            out += ["", f"{skipped} unreadable line(s) of events.jsonl were skipped"]
        return "\n".join(out)
