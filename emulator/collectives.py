"""The daemon's collectives: posts matched in the ledger, run by the wave scheduler, answered when done.

A rank's ``Collective`` is posted (:meth:`Collectives.post`,
:meth:`Collectives.post_p2p`) to the ledger, which files it under its
communicator and sequence number; once every rank has posted it, the matched
posts become a job for the scheduler, whose waves the daemon's loop runs
between polls (:meth:`Collectives.run_wave`); a finished job's ranks get
``Done`` and the session ``coll_completed`` (:meth:`Collectives.finish`). A
communicator that fails answers every rank waiting in it (:meth:`Collectives.fail`).
Everything here runs on the daemon's one loop.
"""

from __future__ import annotations

import time
import traceback
from typing import Protocol

import numpy as np

from emulator.buffers import RankBuffers
from emulator.collective_clock import CollectiveClock
from emulator.events import EventPublisher
from emulator.ledger import CommError, Communicator, Ledger, Posted
from emulator.payloads import Payload, SocketPayloads
from emulator.ranks import RankProcesses
from emulator.scheduler import Job, WaveScheduler, make_job, make_p2p_job
from emulator.straggler import StragglerDetector
from wire import schema as s
from wire.arena import Arena, ArenaError, check_name
from wire.collective_timing import Timing
from wire.kernels import DTYPES, KernelError, itemsize

#: How often progress events go out for one collective, at most.
PROGRESS_INTERVAL_S = 0.05
#: a functional-mode job's place in emulated time: none
_UNTIMED = Timing(0.0, 0.0, "")


class Reply(Protocol):
    """How a reply reaches a rank (the daemon's ``reply``)."""

    def __call__(self, client: bytes, msg: s.Reply, data: np.ndarray | None = None) -> None:
        """Send ``msg`` to ``client``; ``data`` (a socket-transport output) follows it."""


class Collectives:
    """The ledger, the scheduler and what they need: the ranks' arenas, lent buffers and socket bytes."""

    def __init__(self, session: str, gpus_per_node: int, clock: CollectiveClock | None, events: EventPublisher,
                 reply: Reply, ranks: RankProcesses):
        self.session = session  # arenas of another session are refused
        self.gpus_per_node = gpus_per_node
        self.clock = clock  # clocked mode: each collective's place in emulated time (None: functional mode)
        self.events = events
        self.reply = reply
        self.ranks = ranks  # a rank stopped in its debugger is no straggler
        self.ledger = Ledger()
        self.scheduler = WaveScheduler()
        self.stragglers = StragglerDetector()
        self.buffers = RankBuffers()  # tensors ranks registered, mapped (zero-copy collectives)
        self.payloads = SocketPayloads()  # socket-transport inputs received and not yet consumed
        self.arenas: dict[str, Arena] = {}

    @property
    def busy(self) -> bool:
        """Whether jobs are waiting for waves (the loop then polls without sleeping)."""
        return self.scheduler.busy

    def arena(self, name: str) -> Arena:
        """The rank's arena (or p2p scratch buffer) ``name``, mapped on first use."""
        arena = self.arenas.get(name)
        if arena is None:
            check_name(name, self.session)
            # a rank that grew its arena unlinked the old generation: let go of our mapping too
            owner = name.rsplit("-g", 1)[0] + "-g"
            for old in [n for n in self.arenas if n.startswith(owner)]:
                self.arenas.pop(old).close()
            arena = self.arenas[name] = Arena.open(name)
        return arena

    def post_p2p(self, client: bytes, req: s.Collective, payload: Payload | None) -> None:
        """A send or receive; the copy runs in the scheduler once both halves are posted."""
        try:
            self.payloads.hold(client, req, payload, self.ledger.comms)
            comm, pair = self.ledger.post_p2p(client, req)
        except (CommError, KernelError) as e:
            self.payloads.discard(client, req)
            return self.refuse_post(client, req, _comm_error(e))
        if pair is not None:
            try:
                job = make_p2p_job(comm, pair, self.arena, self.payloads.take)
                job.timing = self.timing(comm, pair)
                self.scheduler.submit(job)
            except (ArenaError, KernelError, OSError) as e:
                self.fail(comm, CommError("ncclInvalidArgument", str(e)), extra=pair)

    def post(self, client: bytes, req: s.Collective, payload: Payload | None) -> None:
        """A collective; once every rank has posted it, it runs in the scheduler (or, done rank to rank, is booked)."""
        if not 0 <= req.device < self.gpus_per_node:
            err = CommError(
                "ncclInvalidArgument", f"device {req.device} is not one of this node's {self.gpus_per_node} GPUs"
            )
            return self.refuse_post(client, req, err)
        if req.direct and (req.op not in s.DIRECT_OPS or req.transport is not s.Transport.SHM or req.dtype not in DTYPES):
            err = CommError("ncclInvalidArgument",
                            f"{req.op.value} of {req.dtype} over {req.transport.value} cannot go rank to rank")
            return self.refuse_post(client, req, err)
        try:
            self.payloads.hold(client, req, payload, self.ledger.comms)
            comm, matched = self.ledger.post(client, req)
        except (CommError, KernelError) as e:
            self.payloads.discard(client, req)
            return self.refuse_post(client, req, _comm_error(e))
        # published once the ledger took it: a refused post was never enqueued
        self.events.publish_enqueued(req)
        if matched is None:
            return
        warning = self.stragglers.observe(comm, matched)
        if warning is not None and warning.rank not in self.ranks.debugged:
            self.events.publish(warning)
        if req.direct or req.transport is s.Transport.HOSTS:  # the data moved elsewhere: only the books here
            return self.book_direct(comm, req, matched)
        try:
            job = make_job(comm, matched, self.arena, self.payloads.take, self.buffers.view)
        except (ArenaError, KernelError, OSError) as e:
            return self.fail(comm, CommError("ncclInvalidArgument", str(e)), extra=matched)
        job.timing = self.timing(comm, matched)
        self.scheduler.submit(job)
        self.events.publish(s.CollectiveStarted(comm=comm.comm, seq=req.seq, op=req.op, total_bytes=job.total_bytes))

    def book_direct(self, comm: Communicator, req: s.Collective, matched: list[Posted]) -> None:
        """A collective done rank to rank, or host daemon to host daemon across hosts, matched: its data moved
        without this daemon, so only the books to keep (the sequence, its events) and nobody to answer."""
        self.ledger.complete(comm, req.seq)
        nbytes = 0 if req.op is s.CollOp.BARRIER else req.numel * itemsize(req.dtype)
        self.events.publish(s.CollectiveStarted(comm=comm.comm, seq=req.seq, op=req.op, total_bytes=nbytes))
        # clocked: the time every rank computed for itself from the same t_ready and figures
        t = self.timing(comm, matched) or _UNTIMED
        self.events.publish(s.CollectiveCompleted(comm=comm.comm, seq=req.seq, op=req.op, total_bytes=nbytes,
                                                  seconds=0.0, emulated_start=t.start, emulated_end=t.end,
                                                  algo=t.algo))

    def timing(self, comm: Communicator, posted: list[Posted]) -> Timing | None:
        """Clocked mode: the matched posts' place in emulated time; functional mode: None, no clock."""
        return self.clock.time(comm, posted) if self.clock is not None else None

    def refuse_post(self, client: bytes, req: s.Collective, err: CommError) -> None:
        """A post the ledger will not take: its communicator fails (every rank waiting in it hears why)."""
        comm = self.ledger.comms.get(req.comm)
        if comm is None or comm.failed is err:
            raise err  # answered by the daemon's handle(): nobody else is waiting on it
        self.fail(comm, err, extra=[Posted(client, req)])

    def fail(self, comm: Communicator, err: CommError, extra: list[Posted]) -> None:
        """Fail the communicator: every rank waiting in it gets the error."""
        self.payloads.drop(comm.comm)  # nobody will run on the bytes its ranks sent
        waiting = self.ledger.fail(comm, err) + extra
        waiting += [p for job in self.scheduler.drop(comm) for p in job.posted]
        for p in waiting:
            self.reply(p.client, s.Error(req=p.request.req, code=err.code, message=err.message))
        self.events.publish(s.CommFailed(comm=comm.comm, code=err.code, message=err.message))

    def fail_waits_on(self, dead: dict[int, str]) -> None:
        """Fail every communicator whose oldest collective waits for a dead rank (global rank -> how it went)."""
        for comm in self.ledger.comms.values():
            if comm.failed or not comm.posted:
                continue  # an idle communicator of a finished rank is fine until someone posts to it
            gone = [g for m in comm.members.values() if (g := m.global_rank) in dead]
            seq = min(comm.posted)
            waiting = sorted(g for r in comm.posted[seq] if (g := comm.members[r].global_rank) not in dead)
            if gone and waiting:  # nobody alive waiting (a teardown): nothing to tell
                joined = {comm.members[r].global_rank for r in comm.posted[seq]}
                culprit = min(gone, key=lambda g: g in joined)  # one that never came, if any
                waiters = ", ".join(map(str, waiting))
                err = CommError(
                    "ncclRemoteError", f"{dead[culprit]} while ranks {{{waiters}}} wait in collective #{seq}"
                )
                self.fail(comm, err, extra=[])

    def busy_ranks(self) -> frozenset[int]:
        """Global ranks whose collective is running in the scheduler: waiting for the daemon, not for a peer."""
        return frozenset(
            job.comm.members[p.request.rank].global_rank for job in self.scheduler.jobs for p in job.posted
        )

    def run_wave(self) -> None:
        """One wave of the scheduler: progress events for the running jobs, replies for the finished."""
        progressed, finished = self.scheduler.run_wave()
        now = time.monotonic()
        for job in progressed:
            if job.done >= job.total or now - job.last_progress < PROGRESS_INTERVAL_S:
                continue
            job.last_progress = now
            req = job.first
            self.events.publish(
                s.CollectiveProgress(
                    comm=req.comm, seq=req.seq, done_bytes=job.done * job.itemsize, total_bytes=job.total_bytes
                )
            )
        for job in finished:
            self.finish(job)

    def finish(self, job: Job) -> None:
        """A finished job: ``Done`` to each of its ranks (with its output, over the socket), ``coll_completed``."""
        req = job.first
        if job.error is not None:
            traceback.print_exception(job.error)
            err = CommError("ncclInternalError", f"collective #{req.seq} ({req.op.value}) failed in the emulator: {job.error}")
            return self.fail(job.comm, err, extra=job.posted)
        t = job.timing or _UNTIMED
        if req.op is s.CollOp.SEND:  # point-to-point: no collective sequence to advance
            for p, out in zip(job.posted, job.outputs):
                self.reply(p.client, s.Done(req=p.request.req, comm=req.comm, seq=req.seq, t_start=t.start,
                                            t_end=t.end, algo=t.algo), _sent_back(p, out))
                scratch = self.arenas.pop(p.request.arena, None)  # one buffer per message: done with it
                if scratch is not None:
                    scratch.close()
            return
        self.ledger.complete(job.comm, req.seq)
        first = req.seq == 1
        devices = [p.request.device for p in job.posted] if first else []
        hosts = [job.comm.members[p.request.rank].host for p in job.posted] if first else []
        for p, out in zip(job.posted, job.outputs):
            # a broadcast's root has its output already: it is the input it sent
            back = None if req.op is s.CollOp.BROADCAST and p.request.rank == req.root else _sent_back(p, out)
            self.reply(p.client, s.Done(req=p.request.req, comm=req.comm, seq=req.seq, devices=devices, hosts=hosts,
                                        t_start=t.start, t_end=t.end, algo=t.algo), back)
        self.events.publish(
            s.CollectiveCompleted(
                comm=req.comm, seq=req.seq, op=req.op, total_bytes=job.total_bytes,
                seconds=time.monotonic() - job.started, emulated_start=t.start, emulated_end=t.end, algo=t.algo,
            )
        )

    def close(self) -> None:
        """Unmap every arena and lent buffer."""
        for arena in self.arenas.values():
            arena.close()
        self.buffers.close()


def _sent_back(p: Posted, out: np.ndarray) -> np.ndarray | None:
    """What goes back to the rank after ``Done``: a socket-transport rank's output, if it has one."""
    return out if p.request.transport is s.Transport.SOCKET and out.size else None


def _comm_error(e: CommError | KernelError) -> CommError:
    return e if isinstance(e, CommError) else CommError("ncclInvalidArgument", str(e))
