"""The daemon's events going out: one PUB socket, events sent in batches, in the order published.

The daemon publishes as things happen (:meth:`EventPublisher.publish`); its loop
sends the queue as one frame at the end of a turn once the oldest event has
waited :data:`EVENT_BATCH_S` (:meth:`EventPublisher.flush`), and sleeps no
longer than that (:meth:`EventPublisher.wait_s`). Nothing here is thread-safe:
the daemon's one loop is the only caller.
"""

from __future__ import annotations

import time
import traceback

import zmq

from wire import schema as s

#: How long a published event may wait to go out with later ones. One PUB frame per loop pass
#: woke the daemon's I/O thread and three threads of the session for every collective; on two
#: cores that CPU came out of the collectives' latency. Nothing reads events faster than this.
EVENT_BATCH_S = 0.01
#: ``coll_enqueued`` templates kept (see :meth:`EventPublisher.publish_enqueued`); past this, start over.
MAX_ENQUEUED_TEMPLATES = 4096


class EventPublisher:
    """Owns the daemon's PUB socket and the events waiting for their batch."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # events are never dropped for a slow session
        self.pub.setsockopt(zmq.LINGER, 2000)
        self.pub.bind(endpoint)
        self._outbox: list[bytes] = []  # encoded events, waiting for their batch
        self._fresh: list[s.Event | bytes] = []  # events published in this turn of the loop, not encoded yet
        self._enqueued: dict[tuple, tuple[bytes, bytes, bytes]] = {}  # see publish_enqueued
        self._since = 0.0  # when the oldest queued event was published

    def publish(self, event: s.Event) -> None:
        """Queue an event; :meth:`flush` sends the queue as one frame (one send, not one per event)."""
        self._queue(event)

    def _queue(self, event: s.Event | bytes) -> None:
        """Queue an event, or an encoded one, for :meth:`flush`; the first of a batch starts its clock."""
        if not self._outbox and not self._fresh:
            self._since = time.monotonic()
        self._fresh.append(event)

    def publish_enqueued(self, req: s.Collective) -> None:
        """``publish(CollectiveEnqueued(...))`` for ``req``: the same line, from a template.

        One per rank per collective, the most frequent event: built and encoded
        it was a sixth of a small all-reduce's daemon time. Only its time and
        sequence number change from one call of the same rank at the same site
        to the next, so the rest is encoded once per (rank, call site, shape).
        """
        key = (req.comm, req.rank, req.op, req.dtype, req.numel, req.device, req.site, req.transport)
        parts = self._enqueued.get(key)
        if parts is None:
            if len(self._enqueued) >= MAX_ENQUEUED_TEMPLATES:  # many shapes or sites: start over rather than grow
                self._enqueued.clear()
            line = s.encode(s.CollectiveEnqueued(
                t=1.5, comm=req.comm, seq=123456789, rank=req.rank, op=req.op, dtype=req.dtype, numel=req.numel,
                device=req.device, site=req.site, transport=req.transport,
            ))
            # neither can occur inside a JSON string (its quotes would be escaped there)
            head, rest = line.split(b'"t":1.5,', 1)
            middle, tail = rest.split(b',"seq":123456789,', 1)
            parts = self._enqueued[key] = (head + b'"t":', b"," + middle + b',"seq":', b"," + tail)
        head, middle, tail = parts
        self._queue(b"".join((head, repr(time.time()).encode(), middle, str(req.seq).encode(), tail)))

    def wait_s(self, idle_s: float) -> float:
        """How long the loop may wait for requests before the queued events are due: at most ``idle_s``.

        A batch due within a millisecond goes now, a little early: poll counts
        whole milliseconds (pyzmq truncates), so a wait under one was a 0 ms
        poll and the loop spun until the batch was due, up to 1 ms of every 10
        (five loop turns per small collective).
        """
        if not self._outbox and not self._fresh:
            return idle_s
        wait_s = self._since + EVENT_BATCH_S - time.monotonic()
        if wait_s < 0.001:
            self.flush()
            return idle_s
        return min(idle_s, wait_s)

    def flush(self, force: bool = True) -> None:
        """Send the queued events in the order they were published; unless ``force``, only once the
        oldest has waited ``EVENT_BATCH_S``.

        Events are encoded here, at the end of the loop's turn (the daemon's
        ``serve`` calls this last), not when published: the last request of a
        small collective no longer waits for its own events (enqueued, started)
        to be encoded before the replies go out.
        """
        if self._fresh:
            for event in self._fresh:
                try:
                    self._outbox.append(event if type(event) is bytes else s.encode(event))
                except Exception:  # a bug in one event must not stop the loop (nor lose the others)
                    traceback.print_exc()
            self._fresh = []
        if self._outbox and (force or time.monotonic() - self._since >= EVENT_BATCH_S):
            self.pub.send(s.encode_events(self._outbox))
            self._outbox = []

    def close(self) -> None:
        """Send what is queued, then close the socket (its linger lets the last frame out)."""
        self.flush()
        self.pub.close()
