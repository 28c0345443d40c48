"""The wave scheduler: runs matched collectives in bounded, chunked waves.

A collective is split into chunks of at most ``CHUNK_BYTES`` (NCCL's ring
all-reduce chunk); each wave runs at most ``WAVE_BYTES`` of chunks, taking one
chunk at a time from each runnable collective in turn, so a 1 GiB all-reduce
shares the daemon with a barrier instead of starving it. Between waves the
daemon answers requests and publishes progress.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from emulator import kernels
from emulator.arena import Arena
from emulator.ledger import Communicator, Posted
from emulator.schema import CollOp

CHUNK_BYTES = 2 << 20
WAVE_BYTES = 16 << 20


@dataclass(eq=False)  # identity: jobs hold numpy views
class Job:
    """One matched collective in execution; ``done``/``total`` count elements."""

    comm: Communicator
    posted: list[Posted]
    inputs: list[np.ndarray]  # typed views, one per rank
    outputs: list[np.ndarray]
    total: int
    itemsize: int
    run_range: Callable[[Job, int, int], None]
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    error: Exception | None = None  # set when a kernel raised; the job is then finished
    last_progress: float = 0.0  # when a progress event last went out

    @property
    def first(self):
        return self.posted[0].request

    @property
    def total_bytes(self) -> int:
        return self.total * self.itemsize


# Each kernel handles elements [a, b) of the job's unit space.


def _allreduce(job: Job, a: int, b: int) -> None:
    req = job.first
    acc = kernels.reduce([x[a:b] for x in job.inputs], req.reduce_op, req.dtype)
    for out in job.outputs:
        out[a:b] = acc


def _broadcast(job: Job, a: int, b: int) -> None:
    src = job.inputs[job.first.root][a:b]
    for out in job.outputs:
        if out is not src:
            out[a:b] = src


def _allgather(job: Job, a: int, b: int) -> None:
    # unit g is element g % n of rank g // n's input
    n = job.first.numel
    for k in range(a // n, (b - 1) // n + 1):
        lo, hi = max(a, k * n), min(b, (k + 1) * n)
        seg = job.inputs[k][lo - k * n : hi - k * n]
        for out in job.outputs:
            out[lo:hi] = seg


def _reduce_scatter(job: Job, a: int, b: int) -> None:
    # unit g is element g % n of rank g // n's output; inputs hold size*n elements
    req = job.first
    n = req.out_numel
    for r in range(a // n, (b - 1) // n + 1):
        lo, hi = max(a, r * n), min(b, (r + 1) * n)
        acc = kernels.reduce([x[lo:hi] for x in job.inputs], req.reduce_op, req.dtype)
        job.outputs[r][lo - r * n : hi - r * n] = acc


_KERNELS = {
    CollOp.ALLREDUCE: _allreduce,
    CollOp.BROADCAST: _broadcast,
    CollOp.ALLGATHER: _allgather,
    CollOp.REDUCE_SCATTER: _reduce_scatter,
    CollOp.BARRIER: lambda job, a, b: None,
}


def make_job(comm: Communicator, posted: list[Posted], arena_of: Callable[[str], Arena]) -> Job:
    """Map every rank's buffers for a matched collective."""
    req = posted[0].request
    size = kernels.itemsize(req.dtype)
    n, world = req.numel, len(posted)
    in_n, out_n, total = {
        CollOp.ALLREDUCE: (n, n, n),
        CollOp.BROADCAST: (n, n, n),
        CollOp.ALLGATHER: (n, n * world, n * world),
        CollOp.REDUCE_SCATTER: (n, req.out_numel, n),
        CollOp.BARRIER: (0, 0, 0),
    }[req.op]
    if req.op in (CollOp.ALLREDUCE, CollOp.REDUCE_SCATTER):
        kernels.check_reduce(req.reduce_op, req.dtype)  # here, not mid-wave where it would stop the daemon
    if req.op is CollOp.REDUCE_SCATTER and req.out_numel * world != n:
        raise kernels.KernelError(f"reduce_scatter input of {n} elements does not split into {world} x {req.out_numel}")
    inputs, outputs = [], []
    for p in posted:
        r = p.request
        arena = arena_of(r.arena) if total else None
        if arena is None:
            inputs.append(np.empty(0))
            outputs.append(np.empty(0))
            continue
        inputs.append(kernels.typed(arena.bytes_view(r.in_off, in_n * size), r.dtype))
        if r.out_off == r.in_off and out_n == in_n:
            outputs.append(inputs[-1])  # in place, as NCCL allows
        else:
            outputs.append(kernels.typed(arena.bytes_view(r.out_off, out_n * size), r.dtype))
    return Job(comm, posted, inputs, outputs, total, size, _KERNELS[req.op])


class WaveScheduler:
    """Round-robin over communicators, one chunk at a time, until the wave budget is spent.

    Each communicator's collectives run in the order they were matched, as
    kernels on one NCCL stream do: a later collective never overtakes an
    earlier one of the same communicator.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, wave_bytes: int = WAVE_BYTES):
        self.chunk_bytes = chunk_bytes
        self.wave_bytes = wave_bytes
        self._queues: dict[int, deque[Job]] = {}  # id(comm) -> its jobs, oldest first
        self._turns: deque[int] = deque()  # whose chunk is next

    @property
    def busy(self) -> bool:
        return bool(self._turns)

    @property
    def jobs(self) -> list[Job]:
        """Every queued job, communicator by communicator."""
        return [job for queue in self._queues.values() for job in queue]

    def submit(self, job: Job) -> None:
        key = id(job.comm)
        if key not in self._queues:
            self._queues[key] = deque()
            self._turns.append(key)
        self._queues[key].append(job)

    def run_wave(self) -> tuple[list[Job], list[Job]]:
        """Run one wave; return (jobs that progressed, jobs that finished or failed)."""
        spent = 0
        touched: dict[int, Job] = {}
        finished: list[Job] = []
        while self._turns and spent < self.wave_bytes:
            key = self._turns[0]
            self._turns.rotate(-1)
            queue = self._queues[key]
            job = queue[0]
            b = min(job.total, job.done + max(1, self.chunk_bytes // job.itemsize))
            try:
                if b > job.done:
                    job.run_range(job, job.done, b)
            except Exception as e:  # a kernel bug fails one collective, not the daemon
                job.error = e
                b = job.total
            spent += (b - job.done) * job.itemsize
            job.done = b
            touched[id(job)] = job
            if job.done >= job.total:
                finished.append(job)
                queue.popleft()
                if not queue:
                    del self._queues[key]
                    self._turns.remove(key)
        return list(touched.values()), finished

    def drop(self, comm: Communicator) -> list[Job]:
        """Remove every job of a failed communicator."""
        gone = list(self._queues.pop(id(comm), ()))
        if gone:
            self._turns.remove(id(comm))
        return gone
