"""A rank's collectives in flight, completed in the order they were posted, as kernels on one stream.

Every collective a transport posts (``shim/transport/transports.py``) becomes a
:class:`Pending` at the end of one process-wide queue (``RUNTIME.stream``, with
the lock that posts and completes collectives from any thread); the ``Work`` a
``dist.*`` call returns (:class:`CollectiveWork`) completes the queue up to
its newest collective. A later collective's output thus never lands before an
earlier one's, across all the process's communicators (NCCL has one stream per
group; mirage one per process). Each pending collective carries its
transport, which knows how to complete it: the queue never reaches back into
the process group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from shim.device.storages import storage_key
from shim.rank.runtime import RUNTIME
from shim.transport import profiler as prof
from wire import schema as s

#: Entered with the lock: staging and delivering only touch plain CPU tensors (a collective's
#: unwrapped data, arena views), so the global ``CudaMode`` has nothing to do there, and passing
#: its ``__torch_function__`` on each of their dozen torch calls was a fifth of a small
#: all-reduce's time in the rank.
PLAIN = torch._C.DisableTorchFunction


class Pending:
    """A posted collective whose output is not delivered yet; ``transport`` completes it."""

    def __init__(self, transport, request: s.Collective, req: int, slot: int | None, staged, out_view,
                 deliver: Callable[[torch.Tensor], None] | None, device: int, posted_at: float):
        self.transport, self.request, self.req, self.slot = transport, request, req, slot
        self.staged, self.out_view, self.deliver, self.device = staged, out_view, deliver, device
        self.posted_at = posted_at
        self.targets = getattr(deliver, "targets", [])  # what later collectives must not read before delivery
        self.done = False
        self.ring = 0  # rank to rank: its index in the communicator's rings
        self.books = 0  # across hosts: the id of its request to the head's daemon (answered only with an error)
        self.t_end = 0.0  # clocked mode: when it ends in emulated time (the daemon's answer)

    def ready(self) -> bool:
        """Whether completing it would not block."""
        return self.transport.ready(self)


def append(p: Pending) -> Pending:
    """Queue a collective its transport just posted (lock held)."""
    RUNTIME.stream.pending.append(p)
    return p


def complete_through(last: Pending) -> None:
    """Deliver every posted collective up to and including ``last``, in order (lock held)."""
    pending = RUNTIME.stream.pending
    while not last.done:
        p = pending[0]
        try:
            p.transport.complete(p)
        finally:
            pending.popleft()
            p.transport.release(p)
            p.done = True
            p.staged = p.out_view = p.deliver = p.targets = None


def _storages(tensors) -> set[int]:
    return {storage_key(t) for t in tensors if t.numel()}


def after_writers_of(inputs: list[torch.Tensor]) -> None:
    """Complete the collectives that write what ``inputs`` read (lock held): on a stream a collective
    reads its inputs after earlier ones wrote their outputs."""
    pending = RUNTIME.stream.pending
    if pending:
        reads = _storages(inputs)
        for p in reversed(pending):
            if _storages(p.targets) & reads:
                complete_through(p)
                break


def drain(group_name: str | None = None) -> None:
    """Complete posted collectives, in order, as ``ncclCommFinalize`` does before a communicator lets go:
    those of the group named ``group_name`` (and, the order being a stream's, every earlier one), or all.

    Each waits at most its group's timeout; a failure raises as the collective's own wait would.
    """
    with RUNTIME.stream.lock, PLAIN():
        last = next((p for p in reversed(RUNTIME.stream.pending)
                     if group_name is None or p.transport.comm.group_name == group_name), None)
        if last is not None:
            complete_through(last)


class CollectiveWork(dist.Work):
    """The ``Work`` of a collective call: done once every collective it posted has been delivered.

    ``get_future()`` completes the work first and hands back a completed future,
    so ``then()`` callbacks run at once in the caller's thread — as ``CUDAFuture``
    runs them — and a hook's nested collectives keep the same order on every rank.
    """

    _profile = None  # the profiler's open event for this call (``shim.transport.profiler.profiled``)

    def __init__(self, result, last: Pending | None):
        super().__init__()
        self._result, self._last = result, last

    def wait(self, timeout=None) -> bool:
        if prof.listening():
            prof.record_wait(self._last.transport.comm if self._last is not None else None, self._last)
        self._complete()
        if RUNTIME.clock is not None and self._last is not None:  # the current stream waits for the collective
            RUNTIME.clock.wait_until(self._last.device, self._last.t_end)
        return True

    def _complete(self) -> bool:
        if self._last is not None and not self._last.done:
            with RUNTIME.stream.lock, PLAIN():
                complete_through(self._last)
        if self._profile:
            prof.end(self)
        return True

    def is_completed(self) -> bool:
        last = self._last
        if last is not None and not last.done:
            with RUNTIME.stream.lock, PLAIN():
                if not last.done:
                    upto = list(itertools.takewhile(lambda p: p is not last, RUNTIME.stream.pending)) + [last]
                    if not all(p.ready() for p in upto):
                        return False
                    complete_through(last)  # answered: copying out does not block
        if self._profile:
            prof.end(self)
        return True

    def get_future(self):
        self._complete()
        fut = Future()
        fut.set_result(self._result)
        return fut

    def result(self):
        self._complete()
        return self._result


def work_of(result) -> CollectiveWork:
    """The work of the call that just posted its collectives: complete through the newest."""
    queue = RUNTIME.stream
    with queue.lock:  # (another thread may be completing them)
        return CollectiveWork(result, queue.pending[-1] if queue.pending else None)


class P2PWork(dist.Work):
    """A send or receive in flight (not on the stream: point-to-point is asynchronous in NCCL too);
    ``wait`` blocks until its transport has the message across."""

    def __init__(self, transport, req: int, arena, buf, deliver, device: int, tensors, request: s.Collective):
        super().__init__()
        self.transport, self.req, self.arena, self.buf = transport, req, arena, buf
        self.deliver, self.device, self.tensors, self.request = deliver, device, tensors, request
        self.t_end = 0.0  # clocked mode: when it ends in emulated time (the daemon's answer)
        self._done = False
        self._profile = None  # the profiler's open event for this message (``shim.transport.profiler.profiled``)

    def wait(self, timeout=None) -> bool:
        if prof.listening():
            prof.record_wait(self.transport.comm, None)
        if self._done:
            return True
        try:
            self.transport.finish_p2p(self, timeout.total_seconds() if timeout else self.transport.comm.timeout_s)
        finally:
            self._done = True
            self.buf = None
            if self.arena is not None:
                self.arena.close()
                self.arena.unlink()
            if self._profile:
                prof.end(self)
        if RUNTIME.clock is not None:  # the current stream waits for the message
            RUNTIME.clock.wait_until(self.device, self.t_end)
        return True

    def is_completed(self) -> bool:
        return self._done or self.transport.comm.client.poll(self.req)

    def get_future(self):
        fut = Future()
        self.wait()
        fut.set_result(self.tensors)
        return fut
