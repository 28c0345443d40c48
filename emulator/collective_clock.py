"""Clocked mode's daemon side: when each collective runs in emulated time (issue #16).

The daemon sees every member of a collective arrive, so it is the one place that
knows when, in emulated time, the collective can start: when the last member's
stream lets it (``Collective.t_ready``, each rank's own clock). It then takes as
long as :mod:`emulator.collective_cost` says RCCL would on the profile's GPUs,
and every member learns the same start and end in its ``Done``. A rank that was
slow to arrive thus delays all its peers in emulated time, as on hardware,
whatever the wall clock did.
"""

from __future__ import annotations

from dataclasses import dataclass

from emulator import collective_cost as cost
from emulator.kernels import itemsize
from emulator.ledger import Communicator, Posted
from emulator.profiles import Profile
from emulator.schema import CollOp, Collective

# How each of the daemon's collectives is priced: gather and scatter move what an all-gather of the
# same buffer would (RCCL runs them as rooted point-to-point rings of the same volume); a barrier is
# NCCL's one-element all-reduce.
_PRICED_AS = {
    CollOp.ALLREDUCE: cost.Collective.ALL_REDUCE,
    CollOp.BARRIER: cost.Collective.ALL_REDUCE,
    CollOp.BROADCAST: cost.Collective.BROADCAST,
    CollOp.REDUCE: cost.Collective.REDUCE,
    CollOp.ALLGATHER: cost.Collective.ALL_GATHER,
    CollOp.GATHER: cost.Collective.ALL_GATHER,
    CollOp.SCATTER: cost.Collective.ALL_GATHER,
    CollOp.REDUCE_SCATTER: cost.Collective.REDUCE_SCATTER,
    CollOp.ALLTOALL: cost.Collective.ALL_TO_ALL,
    CollOp.SEND: cost.Collective.SEND_RECV,
    CollOp.RECV: cost.Collective.SEND_RECV,
}


@dataclass(frozen=True)
class Timing:
    """When one collective ran in emulated time (seconds) and how."""

    start: float
    end: float
    algo: str  # "ring/Simple", ...


def nbytes(req: Collective, size: int) -> int:
    """The collective's size as rccl-tests counts it (the model's ``nbytes``)."""
    item = itemsize(req.dtype)
    if req.op is CollOp.BARRIER:
        return 4
    if req.op is CollOp.ALLGATHER or req.op is CollOp.GATHER:
        return req.numel * size * item  # the whole gathered buffer
    if req.op is CollOp.SCATTER:
        return req.numel * size * item  # what the root sends out, share by share
    if req.op is CollOp.ALLTOALL:
        return (sum(req.splits) if req.splits else req.numel) * item
    return req.numel * item  # all_reduce, reduce_scatter (its whole input), broadcast, reduce, send


def ranks_per_node(comm: Communicator, ranks: list[int]) -> int:
    """The most members of ``comm`` among ``ranks`` that share one host (NCCL_HOSTID)."""
    per_host: dict[str, int] = {}
    for r in ranks:
        member = comm.members.get(r)
        host = member.host if member is not None else ""
        per_host[host] = per_host.get(host, 0) + 1
    return max(per_host.values(), default=1)


def timing(profile: Profile, req: Collective, ranks: int, per_node: int, start: float) -> Timing:
    """A collective like ``req`` among ``ranks`` ranks (at most ``per_node`` on one host) that starts at
    ``start``: when it ends, and RCCL's algorithm for it. The daemon times its collectives with this; a rank
    that ran one rank to rank (``shim.direct``) times it with the same figures, so both agree."""
    estimate = cost.estimate(_PRICED_AS[req.op], nbytes(req, ranks), ranks, profile, per_node)
    algo = f"{estimate.algorithm.value}/{estimate.protocol.value}" if ranks > 1 else ""
    return Timing(start, start + estimate.seconds, algo)


class CollectiveClock:
    """Times the collectives of one session on ``profile``'s GPUs."""

    def __init__(self, profile: Profile):
        self.profile = profile

    def time(self, comm: Communicator, posted: list[Posted]) -> Timing:
        """The emulated start and end of the collective (or point-to-point pair) ``posted``."""
        req = posted[0].request
        start = max(p.request.t_ready for p in posted)
        if req.op is CollOp.SEND or req.op is CollOp.RECV:
            members = [p.request.rank for p in posted]
            ranks = 2
        else:
            members = sorted(comm.members)
            ranks = comm.size
        return timing(self.profile, req, ranks, ranks_per_node(comm, members), start)
