"""The run's record: every event, in one order, to ``events.jsonl``, the output logs, the fold and the sink.

Events come from any thread (:meth:`Journal.emit`): the daemon's, the ranks' and nodes' output, the
session's own. One dispatcher thread handles them in order; it alone writes the journal, the logs and the
fold (:class:`~mirage_tui.state.runstate.RunState`, which takes each event before the sink does) and calls the
sink. A write that fails, or a run directory with no room left, becomes :attr:`Journal.write_error`, on
which the session stops the run. The threads that feed the queue (:meth:`Journal.feed`) are drained at
the end for as long as they make progress.
"""

from __future__ import annotations

import errno
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable

from mirage_tui.config.rundir import RunDir
from mirage_tui.output import RankTail
from mirage_tui.state.runstate import Outcome, RunState
from wire import schema as s

#: How often the run directory's free space is checked, and how little counts as full.
SPACE_CHECK_S = 0.5
MIN_FREE_BYTES = 4096
#: Events queued for the journal at most: a rank flooding its output is read only as fast as it is recorded.
EVENT_BACKLOG = 20_000
#: Teardown waits for the event pumps and the journal as long as they make progress, and this long when they do not.
DRAIN_STALL_S = 10.0

Sink = Callable[[s.Event], None]


class Journal:
    """Record ``run``'s events, fold them (:attr:`state`) and show them to ``sink``."""

    def __init__(self, run: RunDir, sink: Sink):
        self.run = run
        self.sink = sink
        # (event, its encoded line if we already have it) — daemon events arrive encoded
        self._events: queue.Queue[tuple[s.Event, bytes | None] | None] = queue.Queue(EVENT_BACKLOG)
        self._written = 0  # events the dispatcher has handled: teardown's measure of progress
        self.write_error: str | None = None  # set when the run directory could not be written
        self._journal = open(run.events, "ab")
        self._log_files: dict[str, object] = {}
        self._dirty_logs: dict[str, object] = {}  # log files written since the last flush
        self._sink_errors: set[str] = set()  # display failures already reported
        self.state = RunState()  # the fold of every event (written by the dispatcher only): diagnoses, the report
        self._hangs: queue.Queue[s.HangDetected] = queue.Queue()
        self.stopping_ranks = False  # set once the session stops the ranks
        #: Told of each rank's registration, on the dispatcher's thread (a multi-host run's launcher).
        self.on_registered: Callable[[s.RankRegistered], None] | None = None
        self._dispatcher: threading.Thread | None = None
        self._feeders: list[threading.Thread] = []
        self._stopping = threading.Event()  # the feeders' signal to queue what is left and end
        self._space_checked = 0.0  # when the run directory's free space was last looked at

    def emit(self, event: s.Event, line: bytes | None = None) -> None:
        """Queue an event for the journal and the sink (any thread); ``line`` is its encoding, if known."""
        self._events.put((event, line))

    def start(self) -> None:
        """Start the dispatcher."""
        self._dispatcher = threading.Thread(target=self._dispatch, name="dispatch", daemon=True)
        self._dispatcher.start()

    def feed(self, target: Callable[[threading.Event], None], name: str) -> None:
        """Run ``target(stopping)`` on a thread: it emits events until ``stopping`` is set, then what is left."""
        t = threading.Thread(target=target, args=(self._stopping,), name=name, daemon=True)
        t.start()
        self._feeders.append(t)

    def fed_by(self, thread: threading.Thread) -> None:
        """Drain ``thread`` too at the end: a feeder that ends by itself (a node's pipe, with its process)."""
        self._feeders.append(thread)

    def follow_rank_files(self, stopping: threading.Event) -> None:
        """Emit the lines of the ranks' output files (a feeder: :meth:`feed`)."""
        tail = RankTail(self.run.ranks)
        while not stopping.wait(0.05):
            for line in tail.poll():
                self.emit(line)
        while lines := tail.poll():  # everything written before the processes ended
            for line in lines:
                self.emit(line)
        for line in tail.poll(final=True):
            self.emit(line)

    def _dispatch(self) -> None:
        # the only writer of events.jsonl and the only caller of the sink
        while True:
            event = self._events.get()
            batch = [event]
            while True:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            for item in batch:
                if item is None:
                    self._flush_journal()
                    return
                e, line = item
                self._written += 1
                self._record(e, line)
                self.state.apply(e)
                if isinstance(e, s.RankRegistered) and self.on_registered is not None:
                    self.on_registered(e)
                if isinstance(e, s.HangDetected):
                    self._flush_journal()  # the diagnosis reads the journal (Flight Recorder dumps)
                    self._hangs.put(e)
                if self.stopping_ranks and isinstance(e, s.CommFailed):
                    continue  # ranks we are stopping take their communicators with them: not news
                try:
                    self.sink(e)
                except Exception as err:  # a broken display must not stop the journal
                    self._sink_failed(err)
            self._flush_journal()

    def _sink_failed(self, err: Exception) -> None:
        """Report a display failure once per kind (not once per event); a reader that went away is let go."""
        if isinstance(err, BrokenPipeError):  # e.g. `mirage run ... | head`: the run goes on, recorded
            self.sink = lambda event: None
            return
        key = f"{type(err).__name__}: {err}"
        if key not in self._sink_errors:
            self._sink_errors.add(key)
            traceback.print_exception(err)

    def _record(self, e: s.Event, line: bytes | None) -> None:
        """Write one event to the journal (and an output line to its log); a failed write stops the run."""
        if self.write_error is not None:
            return  # the run is being stopped; what could not be written is named in the summary
        try:
            self._journal.write((line or s.encode(e)) + b"\n")
        except (OSError, ValueError) as err:
            return self._write_failed(self.run.events, err)
        if isinstance(e, s.OutputLine):
            path = self.run.rank_log(e.rank) if e.rank >= 0 else self.run.node_log(e.node)
            try:
                self._log_line(e)
            except (OSError, ValueError) as err:
                self._write_failed(path, err)

    def _flush_journal(self) -> None:
        if self.write_error is None:
            try:
                self._journal.flush()
            except (OSError, ValueError) as err:
                self._write_failed(self.run.events, err)
        while self._dirty_logs and self.write_error is None:
            path, f = self._dirty_logs.popitem()
            try:
                f.flush()
            except (OSError, ValueError) as err:
                self._write_failed(path, err)

    def _write_failed(self, path: str, err: Exception) -> None:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        self.write_error = f"{path}: {why}"

    def _log_line(self, e: s.OutputLine) -> None:
        path = self.run.rank_log(e.rank) if e.rank >= 0 else self.run.node_log(e.node)
        f = self._log_files.get(path)
        if f is None:
            f = self._log_files[path] = open(path, "a", encoding="utf-8")
        f.write(e.text + "\n")
        self._dirty_logs[path] = f  # flushed with the journal, once per batch of events

    def check_space(self) -> None:
        """A run directory with no room left is a write error even before the session writes: the ranks'
        own output files (``ranks/``) fill it too, and a program that survives its failed writes would
        otherwise end "successfully" with its output lost."""
        now = time.monotonic()
        if now < self._space_checked + SPACE_CHECK_S:
            return
        self._space_checked = now
        try:
            st = os.statvfs(self.run.path)
        except OSError:
            return
        free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may write into the reserved blocks
        if free * st.f_frsize < MIN_FREE_BYTES and self.write_error is None:
            self.write_error = f"{self.run.ranks}: {os.strerror(errno.ENOSPC)}"

    def next_hang(self) -> s.HangDetected | None:
        """The next hang the daemon reported that no one asked for yet, if any."""
        try:
            return self._hangs.get_nowait()
        except queue.Empty:
            return None

    def settle(self, quiet_s: float = 0.1, max_s: float = 1.0) -> None:
        """Let events already on their way reach the fold (a loaded machine delays the dispatcher): return once
        none has been handled for ``quiet_s``, or after ``max_s``."""
        deadline = time.monotonic() + max_s
        last, since = self._written, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if self._written != last or not self._events.empty():
                last, since = self._written, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def drain(self) -> None:
        """Have the feeders queue what is left and end (once every process is gone)."""
        self._stopping.set()
        for t in self._feeders:
            self._join(t)  # a flood of output still in the rank files takes a while to record

    def _join(self, t: threading.Thread) -> None:
        """Join ``t`` while events keep being recorded; give up after ``DRAIN_STALL_S`` without progress."""
        last, since = -1, time.monotonic()
        while t.is_alive():
            t.join(0.2)
            if self._written != last:
                last, since = self._written, time.monotonic()
            elif time.monotonic() - since > DRAIN_STALL_S:
                return

    def _offer(self, item: tuple[s.Event, bytes | None] | None) -> bool:
        """Queue ``item`` while the dispatcher makes progress; False if it stalled (a display that stopped reading)."""
        last, since = -1, time.monotonic()
        while True:
            try:
                self._events.put(item, timeout=0.2)
                return True
            except queue.Full:
                if self._written != last:
                    last, since = self._written, time.monotonic()
                elif time.monotonic() - since > DRAIN_STALL_S:
                    return False

    def close(self, outcome: Outcome | None) -> None:
        """Record the end, let the dispatcher finish and close the journal and the logs (after :meth:`drain`)."""
        ended = outcome is None or self._offer((s.SessionEnded(returncode=outcome.returncode, summary=outcome.summary),
                                                None))
        queued = ended and self._offer(None)
        if self._dispatcher is not None:
            if queued:
                self._join(self._dispatcher)
            if self._dispatcher.is_alive():
                print(f"mirage: the event journal stalled; {self.run.events} may be incomplete", file=sys.stderr)
        try:
            self._journal.close()
        except OSError as err:
            self._write_failed(self.run.events, err)
        for path, f in self._log_files.items():
            try:
                f.close()  # type: ignore[attr-defined]
            except OSError as err:  # a full disk: already the run's outcome, or too late to change it
                self._write_failed(path, err)
