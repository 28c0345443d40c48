"""When one collective runs in emulated time: a ``Collective`` request priced by the cost model.

The daemon times the collectives it runs with :func:`timing`
(:mod:`emulator.collective_clock`); a rank that ran one rank to rank
(``shim.transport.direct``) times it with the same function, so both agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from wire import collective_cost as cost
from wire.kernels import itemsize
from wire.profiles import Profile
from wire.schema import Collective, CollOp

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


# A training step repeats its collectives' sizes: each estimate (~17 us of Python, every (algorithm,
# protocol) pair priced) is worked out once. The model is a pure function of its arguments, and a
# Profile is frozen.
_estimate = functools.lru_cache(maxsize=4096)(cost.estimate)


def timing(profile: Profile, req: Collective, ranks: int, per_node: int, start: float) -> Timing:
    """A collective like ``req`` among ``ranks`` ranks (at most ``per_node`` on one host) that starts at
    ``start``: when it ends, and RCCL's algorithm for it. The daemon times its collectives with this; a rank
    that ran one rank to rank (``shim.transport.direct``) times it with the same figures, so both agree."""
    estimate = _estimate(_PRICED_AS[req.op], nbytes(req, ranks), ranks, profile, per_node)
    algo = f"{estimate.algorithm.value}/{estimate.protocol.value}" if ranks > 1 else ""
    return Timing(start, start + estimate.seconds, algo)
