"""Headless runs (``mirage run``, ``mirage-tui --batch``): prefixed lines, a summary, an exit code.

Never imports Textual: CI machines run this.
"""

from __future__ import annotations

import signal
import sys

from mirage_tui.config.topology import Topology
from mirage_tui.reports import report
from mirage_tui.session import LaunchError, Session
from mirage_tui.state.runstate import Outcome, RunState
from wire import schema as s


def _print_event(event: s.Event, state: RunState) -> None:
    """Print what batch mode shows of ``event``; ``state`` is the session's fold, which has already taken it."""
    if isinstance(event, s.OutputLine):
        prefix = f"[{event.rank}]" if event.rank >= 0 else f"[node{event.node}]"
        out = sys.stdout if event.stream is s.Stream.STDOUT else sys.stderr
        out.write(f"{prefix} {event.text}\n")
        out.flush()
    elif isinstance(event, s.HangReport):
        print(f"mirage: {event.text}", file=sys.stderr, flush=True)
    elif isinstance(event, s.StragglerWarning):
        print(
            f"mirage: warning: rank {event.rank} arrived last at {event.count} collectives in a row of communicator "
            f"{state.comm_label(event.comm)}, {event.mean_margin_s:.2f} s after the others on average (a straggler)",
            file=sys.stderr, flush=True,
        )
    elif isinstance(event, s.RankDebugging) and event.phase is s.DebugPhase.WAITING:
        print(f"mirage: DEBUG: rank {event.rank} is stopped and waits for a debugger ({event.debugger}): "
              f"{event.connect}", file=sys.stderr, flush=True)
    elif isinstance(event, s.CommFailed):
        print(f"mirage: communicator {state.comm_label(event.comm)} failed: {event.code}: {event.message}",
              file=sys.stderr, flush=True)


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def run_batch(topology: Topology) -> int:
    """Run the topology's command to completion; return the session's exit code."""

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    # the session folds each event before its sink sees it, on the same thread: the sink reads the fold
    session = Session(topology, lambda event: _print_event(event, session.state))
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    outcome: Outcome | None = None
    try:
        try:
            session.start()
            outcome = session.wait()
        except LaunchError as e:
            outcome = Outcome(e.returncode, str(e), session.run.path)
        except _Interrupted as e:
            name = signal.Signals(e.signum).name
            outcome = Outcome(128 + e.signum, f"interrupted by {name}; run stopped", session.run.path)
        finally:
            # a second Ctrl-C must not interrupt the teardown
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            session.stop()
    finally:
        session.close(outcome)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert outcome is not None
    if session.state.clocked and session.state.registered:  # ranks ran on the emulated clock
        print(f"mirage: {report.clocked_line(session.state, topology.profile)}", file=sys.stderr, flush=True)
    status = "ok" if outcome.returncode == 0 else "FAILED"
    print(f"mirage: {status}: {outcome.summary} (exit {outcome.returncode}); run dir: {outcome.run_dir}",
          file=sys.stderr, flush=True)
    if session.trace:
        print(f"mirage: trace: {session.trace} (open it in ui.perfetto.dev)", file=sys.stderr, flush=True)
    return outcome.returncode
