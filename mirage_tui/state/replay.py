"""Replay a recorded run: the events of its ``events.jsonl``, at their recorded pace.

UI-free: the console drives a :class:`Player` from its own thread exactly as it
drives a live session (events into a buffer, typed messages to the app), and a
test or a script can iterate one just as well. Pause, step and speed are
thread-safe, so the UI thread controls a player another thread iterates.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from wire import schema as s

#: Playback speeds the ``+``/``-`` keys step through (multiples of the recorded pace).
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class ReplayError(Exception):
    """The directory is not a recorded run; the message is one line."""


@dataclass(frozen=True)
class Recording:
    """A recorded run: its directory, its events in journal order, and how many lines were unreadable."""

    run_dir: str
    events: tuple[s.Event, ...]
    skipped: int  # lines of events.jsonl that were cut short or garbage


def load(run_dir: str) -> Recording:
    """Read ``run_dir/events.jsonl``; a truncated or garbage line is skipped and counted."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.isfile(path):
        raise ReplayError(f"{run_dir} is not a mirage run directory (it has no events.jsonl)")
    with open(path, "rb") as f:
        lines = [line for line in f if line.strip()]
    events = tuple(event for event, _ in s.iter_events(lines))
    return Recording(run_dir=run_dir, events=events, skipped=len(lines) - len(events))


class Player:
    """Iterate a recording's events, each when its recorded time comes round at ``speed``.

    Events are due on a schedule anchored at the first one (and re-anchored
    after a pause or a speed change), not after a sleep per gap, so a burst of
    thousands of lines a second comes out in batches with no drift. ``speed=0``
    plays as fast as possible (tests, snapshots). While paused the iterator
    waits; :meth:`step` lets exactly one event through. :meth:`stop` ends the
    iteration from any thread.
    """

    def __init__(self, recording: Recording, speed: float = 1.0, paused: bool = False) -> None:
        self.recording = recording
        self.speed = speed
        self.paused = paused
        self.position = 0  # events played so far
        self._steps = 0
        self._stopped = False
        self._cv = threading.Condition()
        self._reanchor = True  # the next event starts the schedule afresh
        self._anchor_t = 0.0  # recorded time ...
        self._anchor_wall = 0.0  # ... that fell due at this monotonic time
        self._last_t: float | None = None  # recorded time of the last event played

    @property
    def total(self) -> int:
        """How many events the recording holds."""
        return len(self.recording.events)

    def toggle_pause(self) -> bool:
        """Pause or resume; return whether it is now paused."""
        with self._cv:
            self.paused = not self.paused
            self._reanchor = True  # resume from where it stopped, not where the clock got to
            self._cv.notify_all()
            return self.paused

    def step(self) -> None:
        """Pause (if playing) and let the next event through."""
        with self._cv:
            self.paused = True
            self._steps += 1
            self._cv.notify_all()

    def faster(self) -> float:
        """The next speed up from :data:`SPEEDS`; return it (as-fast-as-possible stays so)."""
        if self.speed <= 0:
            return self.speed
        return self._set_speed(next((v for v in SPEEDS if v > self.speed), SPEEDS[-1]))

    def slower(self) -> float:
        """The next speed down from :data:`SPEEDS`; return it (as-fast-as-possible drops to the fastest)."""
        if self.speed <= 0:
            return self._set_speed(SPEEDS[-1])
        return self._set_speed(next((v for v in reversed(SPEEDS) if v < self.speed), SPEEDS[0]))

    def _set_speed(self, speed: float) -> float:
        with self._cv:
            self.speed = speed
            self._reanchor = True  # the wait in progress is re-timed at the new speed
            self._cv.notify_all()
        return speed

    def stop(self) -> None:
        """End the iteration (any thread)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def __iter__(self) -> Iterator[s.Event]:
        for event in self.recording.events:
            if not self._wait_until(event.t):
                return
            self.position += 1
            self._last_t = event.t
            yield event

    def _wait_until(self, t: float) -> bool:
        """Wait until recorded time ``t`` is due (or a step lets it through); False once stopped."""
        with self._cv:
            while not self._stopped:
                if self.paused:
                    if self._steps:
                        self._steps -= 1
                        return True
                    self._cv.wait()
                    continue
                if self.speed <= 0:
                    return True
                if self._reanchor:
                    self._reanchor = False
                    self._anchor_t = t if self._last_t is None else min(t, self._last_t)
                    self._anchor_wall = time.monotonic()
                remaining = self._anchor_wall + (t - self._anchor_t) / self.speed - time.monotonic()
                if remaining <= 0:
                    return True
                self._cv.wait(min(remaining, 1.0))  # in slices: a recorded gap may be absurdly long
            return False
