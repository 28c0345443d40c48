"""Where the Run screen's events come from: a live session, one started elsewhere, or a recorded run.

Each feed runs on its own thread, appends events to its ``buffer`` and posts
:class:`~mirage_tui.app.messages.EventsReady` to its target; at the end it posts
:class:`~mirage_tui.app.messages.RunFinished`. The screen drains the buffer on
its own thread, so it draws both kinds of run with one code path.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque

import psutil
from textual.message_pump import MessagePump

from mirage_tui.app.messages import EventsReady, ReplayProgress, RunFinished
from mirage_tui.config.topology import Topology
from mirage_tui.session import LaunchError, Session
from mirage_tui.session import registry as sessions
from mirage_tui.state.replay import Player, Recording
from mirage_tui.state.runstate import Outcome
from wire import schema as s

#: Exit code of a run the user stopped from the console (as a Ctrl-C in batch mode).
STOPPED_EXIT = 130
#: How often a replay reports its position (it can play thousands of events a second).
PROGRESS_EVERY_S = 0.1


class Feed:
    """What the Run screen needs of an event source."""

    def __init__(self) -> None:
        self.buffer: deque[s.Event] = deque()  # appended by the feed's thread, drained by the screen
        # an EventsReady is on its way: later events ride on it. One message per event would wake
        # the app's loop thousands of times a second (call_soon_threadsafe each) and starve the keys.
        self._posted = False
        self._target: MessagePump | None = None
        self._thread: threading.Thread | None = None

    def start(self, target: MessagePump) -> None:
        """Start the feed's thread; its messages go to ``target``."""
        self._target = target
        self._thread = threading.Thread(target=self._run, name=f"mirage-{type(self).__name__}")
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the feed's thread is still going."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the feed to end and wait for its thread (safe to call twice, from any thread)."""
        self._request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def run_dir(self) -> str | None:
        """The run directory, once there is one."""
        return None

    def live_ranks(self) -> tuple[dict[int, int], str] | None:
        """A live run's ranks as ``({rank: pid}, session id)``, to signal them; None if not live."""
        return None

    def kill_rank(self, rank: int) -> int | None:
        """SIGKILL ``rank``'s process; return its pid, or None if it has no live process of this run."""
        live = self.live_ranks()
        pid = live[0].get(rank) if live else None
        if live is None or pid is None:
            return None
        try:
            # the pid must still be this run's rank: a pid the kernel gave to another process is not ours to kill
            if psutil.Process(pid).environ().get("MIRAGE_SESSION") != live[1]:
                return None
            os.kill(pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            return None
        return pid

    def claim(self) -> deque[s.Event]:
        """The buffer, for the screen to drain now; events added from here on are announced anew."""
        self._posted = False  # cleared before the drain, so nothing appended after it is stranded
        return self.buffer

    def _push(self, event: s.Event) -> None:
        self.buffer.append(event)  # appended before the flag is read: a drain in progress may take it
        if not self._posted:
            self._posted = True
            assert self._target is not None
            self._target.post_message(EventsReady())

    def _finish(self, outcome: Outcome) -> None:
        assert self._target is not None
        self._target.post_message(RunFinished(outcome))

    def _run(self) -> None:
        raise NotImplementedError

    def _request_stop(self) -> None:
        raise NotImplementedError


class LiveFeed(Feed):
    """Run ``topology`` in a :class:`Session`: start, wait, stop, close (batch mode's steps, no signals)."""

    def __init__(self, topology: Topology) -> None:
        super().__init__()
        self.topology = topology
        self.session: Session | None = None
        self._stop_requested = threading.Event()

    def _request_stop(self) -> None:
        self._stop_requested.set()

    @property
    def run_dir(self) -> str | None:
        return self.session.run.path if self.session else None

    def live_ranks(self) -> tuple[dict[int, int], str] | None:
        session = self.session
        return (dict(session.state.rank_pids), session.run.session) if session else None

    def _run(self) -> None:
        try:
            # the sink runs on the session's dispatcher thread: it may only buffer and post
            session = Session(self.topology, self._push)
        except Exception as e:  # e.g. the log directory cannot be created
            self._finish(Outcome(1, f"could not create the run: {e}", ""))
            return
        self.session = session
        outcome: Outcome | None = None
        result: list[Outcome | BaseException] = []

        def wait() -> None:
            try:
                result.append(session.wait())
            except BaseException as e:  # handed to the feed's thread below
                result.append(e)

        # wait() has no way to be interrupted, so it runs on its own thread and this one
        # watches for the user's quit; session.stop() then ends the nodes and so the wait
        waiter = threading.Thread(target=wait, name="mirage-wait", daemon=True)
        try:
            try:
                if not self._stop_requested.is_set():
                    session.start()
                    waiter.start()
                    while waiter.is_alive() and not self._stop_requested.is_set():
                        waiter.join(0.1)
                if self._stop_requested.is_set() and not result:
                    outcome = Outcome(STOPPED_EXIT, "stopped from the console; run stopped", session.run.path)
                elif isinstance(result[0], BaseException):
                    raise result[0]
                else:
                    outcome = result[0]
            except LaunchError as e:
                outcome = Outcome(e.returncode, str(e), session.run.path)
            except Exception as e:
                outcome = Outcome(1, f"the console's runner failed: {e!r}", session.run.path)
            finally:
                session.stop()
                if waiter.is_alive():
                    waiter.join(10)  # its nodes are gone: it returns within one poll
        finally:
            session.close(outcome)
            self._finish(outcome or Outcome(1, "the run ended without an outcome", session.run.path))


class AttachFeed(Feed):
    """Follow a session another process owns (``mirage-tui --attach``): its journal from the start, then live.

    The owner keeps reaping the run; this feed only reads ``events.jsonl`` as it grows and signals
    processes (a rank's stacks, killing a rank, SIGINT to the owner to stop the run). Stopping the
    feed detaches: the run goes on.
    """

    def __init__(self, entry: sessions.SessionEntry) -> None:
        super().__init__()
        self.entry = entry
        self.rank_pids: dict[int, int] = {}  # from the journal's registrations (this thread writes, others copy)
        self._detach = threading.Event()

    @property
    def run_dir(self) -> str:
        return self.entry.run_dir

    def live_ranks(self) -> tuple[dict[int, int], str] | None:
        return dict(self.rank_pids), self.entry.session

    def _request_stop(self) -> None:
        self._detach.set()

    def stop_run(self) -> bool:
        """Ask the owner to stop the run, as Ctrl-C in its terminal would; False if it is gone."""
        if not self.entry.alive:
            return False
        try:
            os.kill(self.entry.pid, signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    def _run(self) -> None:
        run_dir = self.entry.run_dir
        try:
            journal = open(os.path.join(run_dir, "events.jsonl"), "rb")
        except OSError as e:
            self._finish(Outcome(1, f"cannot read the session's journal: {e}", run_dir))
            return
        partial = b""
        with journal:
            while True:
                owner_gone = not self.entry.alive  # read before the last read: nothing it wrote is missed
                chunk = journal.read(1 << 20)
                if chunk:
                    lines = (partial + chunk).split(b"\n")
                    partial = lines.pop()  # a line the owner is still writing
                    for event, _ in s.iter_events(lines):
                        if isinstance(event, s.RankRegistered):
                            self.rank_pids[event.rank] = event.pid
                        self._push(event)
                        if isinstance(event, s.SessionEnded):
                            self._finish(Outcome(event.returncode, event.summary, run_dir))
                            return
                    continue
                if self._detach.is_set():
                    self._finish(Outcome(0, "detached; the run goes on", run_dir))
                    return
                if owner_gone:
                    self._finish(Outcome(1, f"the session's owner (pid {self.entry.pid}) ended without "
                                         f"recording the run's end (killed?); 'mirage cleanup' removes what it left",
                                         run_dir))
                    return
                self._detach.wait(0.1)


class ReplayFeed(Feed):
    """Play a recording through a :class:`Player`; the outcome is the one the recording ended with."""

    def __init__(self, recording: Recording, speed: float = 1.0) -> None:
        super().__init__()
        self.recording = recording
        self.player = Player(recording, speed=speed)

    @property
    def run_dir(self) -> str:
        return self.recording.run_dir

    def _request_stop(self) -> None:
        self.player.stop()

    def progress(self) -> ReplayProgress:
        """The player's position, as a message."""
        p = self.player
        return ReplayProgress(p.position, p.total, p.speed, p.paused)

    def _run(self) -> None:
        assert self._target is not None
        ended: s.SessionEnded | None = None
        shown = 0.0
        for event in self.player:
            if isinstance(event, s.SessionEnded):
                ended = event
            self._push(event)
            now = time.monotonic()
            if now - shown > PROGRESS_EVERY_S or self.player.paused:
                shown = now
                self._target.post_message(self.progress())
        self._target.post_message(self.progress())
        run_dir = self.recording.run_dir
        if ended is not None:
            outcome = Outcome(ended.returncode, ended.summary, run_dir)
        elif self.player.position < self.player.total:
            outcome = Outcome(STOPPED_EXIT, "replay stopped", run_dir)
        else:
            outcome = Outcome(1, "the recording ends without the run's end (cut short?)", run_dir)
        self._finish(outcome)
