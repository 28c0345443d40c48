"""Clocked mode's daemon side: when each collective runs in emulated time (issue #16).

The daemon sees every member of a collective arrive, so it is the one place that
knows when, in emulated time, the collective can start: when the last member's
stream lets it (``Collective.t_ready``, each rank's own clock). It then takes as
long as :mod:`wire.collective_cost` says RCCL would on the profile's GPUs,
and every member learns the same start and end in its ``Done``. A rank that was
slow to arrive thus delays all its peers in emulated time, as on hardware,
whatever the wall clock did.
"""

from __future__ import annotations

from emulator.ledger import Communicator, Posted
from wire.collective_timing import Timing, timing
from wire.profiles import Profile
from wire.schema import CollOp


def ranks_per_node(comm: Communicator, ranks: list[int]) -> int:
    """The most members of ``comm`` among ``ranks`` that share one host (NCCL_HOSTID)."""
    per_host: dict[str, int] = {}
    for r in ranks:
        member = comm.members.get(r)
        host = member.host if member is not None else ""
        per_host[host] = per_host.get(host, 0) + 1
    return max(per_host.values(), default=1)


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
