"""The collective ledger: communicators, their members, and collectives posted.

A collective becomes runnable when every rank of its communicator has posted
the same sequence number. The ledger checks what NCCL checks at that point
(two ranks on one GPU; ranks disagreeing on what they run) and hands the
matched set to the scheduler. It remembers, per rank, the last sequence number
enqueued and completed, which is what the hang detector will read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from wire.profiles import bus_id
from wire.schema import Collective, CollOp, CommInit, Transport, WorldFormation, WorldPhase


class CommError(Exception):
    """A communicator-level failure, reported to every rank with an NCCL code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Posted:
    """One rank's half of a collective: its request and where to reply."""

    client: bytes
    request: Collective
    at: float = field(default_factory=time.monotonic)  # when this rank arrived


@dataclass
class Communicator:
    comm: str
    size: int
    members: dict[int, CommInit] = field(default_factory=dict)
    posted: dict[int, dict[int, Posted]] = field(default_factory=dict)  # seq -> rank -> Posted
    last_enqueued: dict[int, int] = field(default_factory=dict)
    last_completed: dict[int, int] = field(default_factory=dict)
    p2p: dict[tuple[int, int, int], dict[CollOp, Posted]] = field(default_factory=dict)  # (src, dst, n)
    devices_checked: bool = False
    failed: CommError | None = None


def _fingerprint(r: Collective) -> str:
    return (
        f"CollectiveFingerPrint(SequenceNumber={r.seq}, OpType={r.op.name}, "
        f"TensorShape=[{r.numel}], TensorDtypes={r.dtype}, "
        f"TensorDeviceTypes=TensorOptions(device=cuda:{r.device}))"
    )


class Ledger:
    """Every communicator of the session, keyed by its id."""

    def __init__(self) -> None:
        self.comms: dict[str, Communicator] = {}

    def join(self, init: CommInit) -> Communicator:
        """Register a rank in its communicator (created by the first joiner)."""
        if init.size < 1 or not 0 <= init.rank < init.size:
            raise CommError("ncclInvalidArgument", f"rank {init.rank} outside communicator of size {init.size}")
        comm = self.comms.get(init.comm)
        if comm is None:
            comm = self.comms[init.comm] = Communicator(init.comm, init.size)
        if comm.size != init.size:
            raise CommError(
                "ncclInvalidUsage", f"rank {init.rank} joined with size {init.size}, but the communicator has {comm.size}"
            )
        comm.members[init.rank] = init
        return comm

    def _live_member(self, req: Collective) -> Communicator:
        """The communicator ``req`` is posted to, if the rank joined it and it has not failed."""
        comm = self.comms.get(req.comm)
        if comm is None or req.rank not in comm.members:
            raise CommError("ncclInvalidUsage", f"rank {req.rank} posted to communicator {req.comm} before joining it")
        if comm.failed:
            raise comm.failed
        return comm

    def post(self, client: bytes, req: Collective) -> tuple[Communicator, list[Posted] | None]:
        """Record a rank's collective; return the full matched set once all ranks posted."""
        comm = self._live_member(req)
        if req.seq <= comm.last_enqueued.get(req.rank, 0):
            raise CommError(
                "ncclInvalidUsage", f"rank {req.rank} posted collective #{req.seq} out of order"
            )
        comm.last_enqueued[req.rank] = req.seq
        slot = comm.posted.setdefault(req.seq, {})
        slot[req.rank] = Posted(client, req)
        if len(slot) < comm.size:
            return comm, None
        matched = [slot[r] for r in range(comm.size)]
        try:
            self._check_devices(comm, matched)
            self._check_match(matched)
        except CommError:
            # the other ranks stay in the slot so ``fail`` finds and answers
            # them; the poster is answered by the caller
            del slot[req.rank]
            raise
        del comm.posted[req.seq]
        return comm, matched

    def post_p2p(self, client: bytes, req: Collective) -> tuple[Communicator, list[Posted] | None]:
        """Record a send or a receive; return [send, recv] once both halves of a message are posted."""
        comm = self._live_member(req)
        if not 0 <= req.peer < comm.size or req.peer == req.rank:
            raise CommError("ncclInvalidArgument", f"rank {req.rank}: invalid peer {req.peer} for {req.op.value}")
        src, dst = (req.rank, req.peer) if req.op is CollOp.SEND else (req.peer, req.rank)
        key = (src, dst, req.seq)
        halves = comm.p2p.setdefault(key, {})
        if req.op in halves:
            raise CommError("ncclInvalidUsage", f"rank {req.rank} posted {req.op.value} #{req.seq} to {req.peer} twice")
        halves[req.op] = Posted(client, req)
        if len(halves) < 2:
            return comm, None
        del comm.p2p[key]
        send, recv = halves[CollOp.SEND], halves[CollOp.RECV]
        if (send.request.dtype, send.request.numel) != (recv.request.dtype, recv.request.numel):
            raise CommError(
                "ncclInvalidUsage",
                f"rank {src} sends {send.request.numel} x {send.request.dtype} but rank {dst} receives "
                f"{recv.request.numel} x {recv.request.dtype} (message #{req.seq} between them)",
            )
        return comm, [send, recv]

    def complete(self, comm: Communicator, seq: int) -> None:
        for rank in range(comm.size):
            comm.last_completed[rank] = seq

    def fail(self, comm: Communicator, err: CommError) -> list[Posted]:
        """Mark the communicator failed; return every rank still waiting in it."""
        comm.failed = err
        waiting = [p for slot in comm.posted.values() for p in slot.values()]
        waiting += [p for halves in comm.p2p.values() for p in halves.values()]
        comm.posted.clear()
        comm.p2p.clear()
        return waiting

    @staticmethod
    def _check_devices(comm: Communicator, matched: list[Posted]) -> None:
        # NCCL checks this once, when the communicator connects its ranks
        if comm.devices_checked:
            return
        comm.devices_checked = True
        seen: dict[tuple[str, int], int] = {}
        for p in matched:
            member = comm.members[p.request.rank]
            key = (member.host, p.request.device)
            if key in seen:
                raise CommError(
                    "ncclInvalidUsage",
                    f"Duplicate GPU detected : rank {seen[key]} and rank {p.request.rank} "
                    f"both on CUDA device {bus_id(p.request.device)}",
                )
            seen[key] = p.request.rank

    @staticmethod
    def _check_match(matched: list[Posted]) -> None:
        first = matched[0].request
        for p in matched[1:]:
            r = p.request
            same = (r.op, r.dtype) == (first.op, first.dtype)
            if r.op is not CollOp.ALLTOALL:  # all-to-all sizes differ per rank by design
                same = same and r.numel == first.numel
            if r.op in (CollOp.ALLREDUCE, CollOp.REDUCE, CollOp.REDUCE_SCATTER):
                same = same and r.reduce_op == first.reduce_op
            if r.op in (CollOp.BROADCAST, CollOp.REDUCE, CollOp.GATHER, CollOp.SCATTER):
                same = same and r.root == first.root
            if same and (r.transport is Transport.HOSTS) != (first.transport is Transport.HOSTS):
                raise CommError(
                    "ncclInvalidUsage",
                    f"Rank {first.rank} and rank {r.rank} disagree on whether collective #{r.seq} goes host daemon "
                    "to host daemon: run every host with the same mirage and settings",
                )
            if same and r.direct != first.direct:
                raise CommError(
                    "ncclInvalidUsage",
                    f"Rank {first.rank} and rank {r.rank} disagree on whether collective #{r.seq} goes rank to rank: "
                    "set MIRAGE_DIRECT_MAX_BYTES alike on every rank",
                )
            if not same:
                raise CommError(
                    "ncclInvalidUsage",
                    "Detected mismatch between collectives on ranks. "
                    f"Rank {first.rank} is running collective: {_fingerprint(first)}, "
                    f"but Rank {r.rank} is running collective: {_fingerprint(r)}. "
                    f"Rank {first.rank} called it at {first.site or '?'}; Rank {r.rank} at {r.site or '?'}",
                )


@dataclass
class Arrival:
    """A rank that reached ``init_process_group`` of a world."""

    rank: int
    pid: int
    site: str
    host: str = ""  # the machine ``pid`` runs on
    at: float = field(default_factory=time.monotonic)  # when it started waiting
    formed: bool = False  # init_process_group returned


@dataclass
class World:
    """One world being formed: the ranks that arrived, out of ``size``."""

    world: str
    size: int
    arrived: dict[int, Arrival] = field(default_factory=dict)
    reported: bool = False  # the hang detector reported it (once)


class Worlds:
    """Worlds in formation, keyed by ``WorldFormation.world``; a world leaves once every rank formed it."""

    def __init__(self) -> None:
        self.worlds: dict[str, World] = {}

    def record(self, msg: WorldFormation, alive) -> None:
        """Note a rank entering or leaving ``init_process_group``; ``alive(pid, host)`` tells live processes."""
        world = self.worlds.get(msg.world)
        if msg.phase is WorldPhase.JOINING:
            if world is not None:
                # processes that are gone, and a rank formed before (a new world under an old name:
                # new processes, the same rendezvous address), belong to an earlier world
                stale = msg.rank in world.arrived and world.arrived[msg.rank].formed
                world.arrived = {r: a for r, a in world.arrived.items() if alive(a.pid, a.host) and not stale}
            if world is None or not world.arrived:
                world = self.worlds[msg.world] = World(msg.world, msg.size)
            world.size = max(world.size, msg.size)  # ranks that disagree: the larger world is the one waited for
            world.arrived[msg.rank] = Arrival(msg.rank, msg.pid, msg.site, msg.host)
            return
        arrival = world.arrived.get(msg.rank) if world is not None else None
        if arrival is None:
            return
        if msg.phase is WorldPhase.FAILED:
            del world.arrived[msg.rank]
        else:
            arrival.formed = True
        formed = len(world.arrived) == world.size and all(a.formed for a in world.arrived.values())
        if formed or not world.arrived:
            del self.worlds[msg.world]
