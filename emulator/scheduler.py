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

from emulator.ledger import Communicator, Posted
from wire import kernels
from wire.arena import Arena
from wire.collective_timing import Timing
from wire.schema import Collective, CollOp, Transport

#: 512 KiB, NCCL's step size (its 4 MiB buffer over 8 steps); smaller than the 2 MiB it was, a
#: chunk's first output is still in the core's 2 MiB L2 when the kernel copies it to the others
#: (a 64 MiB two-rank all-reduce, in process: 12.7 ms, against 16.9 ms in 2 MiB chunks).
CHUNK_BYTES = 512 << 10
WAVE_BYTES = 16 << 20
#: (client, buffer id, byte offset, bytes) -> a uint8 view of a buffer the rank registered
BufferOf = Callable[[bytes, int, int, int], np.ndarray]


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
    plan: list = field(default_factory=list)  # ALLTOALL: the copies to make (see _alltoall)
    # the outputs once each: socket-transport ranks of a collective whose outputs are all alike
    # (all-reduce, all-gather, broadcast) share one buffer, written once and sent to each
    targets: list[np.ndarray] = field(default_factory=list)
    timing: Timing | None = None  # clocked mode: when it runs in emulated time (emulator/collective_clock.py)

    def __post_init__(self):
        if not self.targets:
            self.targets = list({id(o): o for o in self.outputs}.values())

    @property
    def first(self):
        return self.posted[0].request

    @property
    def total_bytes(self) -> int:
        return self.total * self.itemsize


# Each kernel handles elements [a, b) of the job's unit space.


def _allreduce(job: Job, a: int, b: int) -> None:
    # reduced into the first output (rank 0's arena, or the socket ranks' shared buffer), then
    # copied to the others: one pass less than through a temporary. Outputs are each rank's own
    # buffer, so the first aliases no input but rank 0's, which it may.
    req = job.first
    first = job.targets[0][a:b]
    kernels.reduce_into([x[a:b] for x in job.inputs], req.reduce_op, req.dtype, first)
    for out in job.targets[1:]:
        out[a:b] = first


def _broadcast(job: Job, a: int, b: int) -> None:
    root = job.first.root
    src = job.inputs[root][a:b]
    for out in job.targets:
        if out is not job.outputs[root] or out is not job.inputs[root]:  # the root's in-place buffer has it
            out[a:b] = src


def _allgather(job: Job, a: int, b: int) -> None:
    # unit g is element g % n of rank g // n's input
    n = job.first.numel
    for k in range(a // n, (b - 1) // n + 1):
        lo, hi = max(a, k * n), min(b, (k + 1) * n)
        seg = job.inputs[k][lo - k * n : hi - k * n]
        for out in job.targets:
            out[lo:hi] = seg


def _reduce_scatter(job: Job, a: int, b: int) -> None:
    # unit g is element g % n of rank g // n's output; inputs hold size*n elements
    req = job.first
    n = req.out_numel
    for r in range(a // n, (b - 1) // n + 1):
        lo, hi = max(a, r * n), min(b, (r + 1) * n)
        acc = kernels.reduce([x[lo:hi] for x in job.inputs], req.reduce_op, req.dtype)
        job.outputs[r][lo - r * n : hi - r * n] = acc


def _reduce(job: Job, a: int, b: int) -> None:
    req = job.first
    job.outputs[req.root][a:b] = kernels.reduce([x[a:b] for x in job.inputs], req.reduce_op, req.dtype)


def _gather(job: Job, a: int, b: int) -> None:
    n = job.first.numel
    out = job.outputs[job.first.root]
    for k in range(a // n, (b - 1) // n + 1):
        lo, hi = max(a, k * n), min(b, (k + 1) * n)
        out[lo:hi] = job.inputs[k][lo - k * n : hi - k * n]


def _scatter(job: Job, a: int, b: int) -> None:
    # unit g is element g % n of rank g // n's output, taken from the root's input
    n = job.first.numel
    src = job.inputs[job.first.root]
    for r in range(a // n, (b - 1) // n + 1):
        lo, hi = max(a, r * n), min(b, (r + 1) * n)
        job.outputs[r][lo - r * n : hi - r * n] = src[lo:hi]


def _alltoall(job: Job, a: int, b: int) -> None:
    # the plan lists copies (unit start, length, src rank, src offset, dst rank, dst offset) in unit order
    for start, length, src, src_off, dst, dst_off in job.plan:
        lo, hi = max(a, start), min(b, start + length)
        if lo < hi:
            job.outputs[dst][dst_off + lo - start : dst_off + hi - start] = job.inputs[src][
                src_off + lo - start : src_off + hi - start
            ]


_KERNELS = {
    CollOp.ALLREDUCE: _allreduce,
    CollOp.BROADCAST: _broadcast,
    CollOp.REDUCE: _reduce,
    CollOp.ALLGATHER: _allgather,
    CollOp.GATHER: _gather,
    CollOp.SCATTER: _scatter,
    CollOp.REDUCE_SCATTER: _reduce_scatter,
    CollOp.ALLTOALL: _alltoall,
    CollOp.BARRIER: lambda job, a, b: None,
}


def _no_data(job: Job, a: int, b: int) -> None:
    """An estimate-mode collective's kernel: its elements are walked (progress, the wave's budget) and none
    is there to move."""


def _p2p(job: Job, a: int, b: int) -> None:
    job.outputs[1][a:b] = job.inputs[0][a:b]


def make_p2p_job(comm: Communicator, pair: list[Posted], arena_of: Callable[[str], Arena],
                 payload_of: Callable[[Posted], np.ndarray | kernels.Segmented] | None = None) -> Job:
    """Map a matched [send, recv] pair: the sender's input is copied into the receiver's output."""
    send, recv = pair
    size = kernels.itemsize(send.request.dtype)
    n = send.request.numel
    if not n or send.request.transport is Transport.SHAPES:  # nothing, or no values (estimate mode)
        return Job(comm, pair, [np.empty(0), np.empty(0)], [np.empty(0), np.empty(0)], n, size, _no_data)
    src, _ = rank_buffers(send, n * size, 0, arena_of, payload_of)
    _, dst = rank_buffers(recv, 0, n * size, arena_of, payload_of)
    if dst is None:
        dst = np.empty(n * size, np.uint8)
    dtype = send.request.dtype
    return Job(comm, pair, [kernels.typed(src, dtype), np.empty(0)], [np.empty(0), kernels.typed(dst, dtype)], n,
               size, _p2p)


def input_elements(req: Collective, world: int) -> int:
    """Elements rank ``req.rank`` hands the daemon for its collective (what it stages, or sends as frames)."""
    n, mine = req.numel, req.rank == req.root
    return {
        CollOp.BROADCAST: n if mine else 0,  # only the root's buffer is read
        CollOp.SCATTER: n * world if mine else 0,
        CollOp.BARRIER: 0,
        CollOp.RECV: 0,
    }.get(req.op, n)


def rank_buffers(p: Posted, in_bytes: int, out_bytes: int, arena_of: Callable[[str], Arena],
                 payload_of: Callable[[Posted], np.ndarray | kernels.Segmented] | None,
                 buffer_of: BufferOf | None = None):
    """Where one rank's input bytes come from and where its output goes: the transport seam.

    SHM: both are views of the rank's arena, or of a buffer it registered
    (``in_buf``/``out_buf``: its tensor itself, zero-copy; ``buffer_of`` maps
    (client, id, offset, bytes) to a view), each side on its own; the same
    view when the ranges coincide: in place, as NCCL allows. SOCKET: the input is the payload that
    arrived as data frames (checked against ``in_bytes``) and the output is
    None, for the caller to allocate; the daemon sends it back after ``Done``.
    Returns raw uint8 (input, output).
    """
    r = p.request
    if r.transport is Transport.SOCKET:
        data = payload_of(p) if payload_of is not None else None
        got = 0 if data is None else len(data)
        if got != in_bytes:
            raise kernels.KernelError(
                f"rank {r.rank} sent {got} bytes of data frames for {r.op.value} of {r.numel} x {r.dtype}; "
                f"its shape needs {in_bytes}"
            )
        return (data if in_bytes else np.empty(0, np.uint8)), None
    if r.in_buf or r.out_buf:
        if buffer_of is None:
            raise kernels.KernelError(f"rank {r.rank}: registered buffers are not served here")

        def side(buf: int, off: int, nbytes: int) -> np.ndarray:
            return buffer_of(p.client, buf, off, nbytes) if buf else arena_of(r.arena).bytes_view(off, nbytes)

        inp = side(r.in_buf, r.in_off, in_bytes)
        if r.out_buf == r.in_buf and r.out_off == r.in_off and out_bytes == in_bytes:
            return inp, inp
        return inp, side(r.out_buf, r.out_off, out_bytes)
    arena = arena_of(r.arena)
    inp = arena.bytes_view(r.in_off, in_bytes)
    if r.out_off == r.in_off and out_bytes == in_bytes:
        return inp, inp
    return inp, arena.bytes_view(r.out_off, out_bytes)


def _alltoall_plan(reqs: list[Collective]) -> tuple[list[tuple[int, int, int, int, int, int]], list[int]]:
    """Copy segments for an all-to-all, and each rank's output size, from every rank's splits."""
    world = len(reqs)
    for r in reqs:
        if len(r.splits) != world or sum(r.splits) != r.numel or min(r.splits, default=0) < 0:
            raise kernels.KernelError(
                f"rank {r.rank}: all_to_all splits {r.splits} must be {world} sizes adding up to {r.numel}"
            )
    plan, unit = [], 0
    out_sizes = [sum(reqs[k].splits[d] for k in range(world)) for d in range(world)]
    for r, want in zip(reqs, out_sizes):
        if r.out_numel != want:  # else the rank would read stale arena bytes, or lose some
            raise kernels.KernelError(
                f"rank {r.rank}: all_to_all output holds {r.out_numel} elements but its peers send {want}"
            )
    for dst in range(world):
        dst_off = 0
        for src in range(world):
            length = reqs[src].splits[dst]
            if length:
                plan.append((unit, length, src, sum(reqs[src].splits[:dst]), dst, dst_off))
            unit += length
            dst_off += length
    return plan, out_sizes


def make_job(comm: Communicator, posted: list[Posted], arena_of: Callable[[str], Arena],
             payload_of: Callable[[Posted], np.ndarray | kernels.Segmented] | None = None,
             buffer_of: BufferOf | None = None) -> Job:
    """Map every rank's buffers for a matched collective (arenas by name; registered buffers; socket ranks' payloads)."""
    req = posted[0].request
    reqs = [p.request for p in posted]
    size = kernels.itemsize(req.dtype)
    n, world, root = req.numel, len(posted), req.root
    if req.op in (CollOp.ALLREDUCE, CollOp.REDUCE, CollOp.REDUCE_SCATTER):
        kernels.check_reduce(req.reduce_op, req.dtype)  # here, not mid-wave where it would stop the daemon
    if req.op is CollOp.REDUCE_SCATTER and req.out_numel * world != n:
        raise kernels.KernelError(f"reduce_scatter input of {n} elements does not split into {world} x {req.out_numel}")
    if req.op in (CollOp.BROADCAST, CollOp.REDUCE, CollOp.GATHER, CollOp.SCATTER) and not 0 <= root < world:
        raise kernels.KernelError(f"root {root} is not a rank of this {world}-rank communicator")
    plan: list = []
    out_sizes: list[int] = []
    if req.op is CollOp.ALLTOALL:
        plan, out_sizes = _alltoall_plan(reqs)
    # (input, output) elements of rank r; all-reduce (most collectives, many tiny) skips building
    # these tables, a few microseconds of a small all-reduce's daemon time
    same = req.op is CollOp.ALLREDUCE or req.op is CollOp.BROADCAST
    shapes = None if same else {
        CollOp.ALLREDUCE: lambda r: (n, n),
        CollOp.BROADCAST: lambda r: (n, n),
        CollOp.REDUCE: lambda r: (n, n if r == root else 0),
        CollOp.ALLGATHER: lambda r: (n, n * world),
        CollOp.GATHER: lambda r: (n, n * world if r == root else 0),
        CollOp.SCATTER: lambda r: (n * world if r == root else 0, n),
        CollOp.REDUCE_SCATTER: lambda r: (n, req.out_numel),
        CollOp.ALLTOALL: lambda r: (reqs[r].numel, out_sizes[r]),
        CollOp.BARRIER: lambda r: (0, 0),
    }[req.op]
    # the units the kernel walks
    total = n if same else {
        CollOp.ALLGATHER: n * world,
        CollOp.GATHER: n * world,
        CollOp.SCATTER: n * world,
        CollOp.ALLTOALL: sum(r.numel for r in reqs),
        CollOp.BARRIER: 0,
    }.get(req.op, n)
    if any(r.transport is Transport.SHAPES for r in reqs):  # estimate mode: no values, nothing to move
        return Job(comm, posted, [np.empty(0)] * world, [np.empty(0)] * world, total, size, _no_data, plan=plan)
    inputs, outputs = [], []
    alike = req.op in (CollOp.ALLREDUCE, CollOp.ALLGATHER, CollOp.BROADCAST)  # every rank's output the same
    shared: np.ndarray | None = None
    for rank, p in enumerate(posted):
        r = p.request
        in_n, out_n = (n, n) if same else shapes(rank)
        if not total:
            inputs.append(np.empty(0))
            outputs.append(np.empty(0))
            continue
        if r.transport is Transport.SOCKET:
            in_n = input_elements(r, world)  # a broadcast's non-root sends nothing
        inp, out = rank_buffers(p, in_n * size, out_n * size, arena_of, payload_of, buffer_of)
        inputs.append(kernels.typed(inp, r.dtype))
        if out is inp:
            outputs.append(inputs[-1])
            continue
        if out is None:  # sent back as a frame: one buffer serves every socket rank when outputs are alike
            if alike and shared is not None:
                outputs.append(shared)
                continue
            outputs.append(kernels.typed(np.empty(out_n * size, np.uint8), r.dtype))
            shared = outputs[-1] if alike else None
            continue
        outputs.append(kernels.typed(out, r.dtype))
    return Job(comm, posted, inputs, outputs, total, size, _KERNELS[req.op], plan=plan)


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
