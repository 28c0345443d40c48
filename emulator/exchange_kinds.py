"""What each collective across hosts exchanges: its pieces, who finishes each, where the bytes come from and go.

A collective across hosts (:mod:`emulator.host_exchange`) walks a flat space
of elements, its *units*, cut into pieces; each piece has one *owner*, the host
that finishes it:

- a **reducing** kind (all-reduce, reduce-scatter): every other host reduces
  its own ranks over the piece and sends that partial to the owner, which
  reduces every host's partial, its own included, in host order;
- a **copying** kind (all-gather, broadcast): the owner holds the piece's bytes
  (its rank's input);
- a **spreading** kind (all-reduce, all-gather, broadcast): the owner then sends
  the finished piece to every other host, since every rank needs it; a
  reduce-scatter's piece is needed only by its rank, on its owner;
- a **chaining** kind (broadcast) spreads its piece along a chain of hosts
  instead, as RCCL's ring broadcast does: the owner sends each chunk only to
  the next host, which forwards it to the one after as it arrives, so every
  host's link carries the buffer at most once, not the owner's H − 1 times.

Each kind below is that choice and its buffers, in a few lines:

========================  ======================  ===============================  =======================
kind                      units                   a piece's owner                  reduces / spreads
========================  ======================  ===============================  =======================
all-reduce                ``numel``               host ``j`` owns segment ``j``    yes / yes
reduce-scatter            ``numel`` (the input)   the host of the rank it goes to  yes / no
all-gather                ``numel × world``       the host of the rank it is from  no / yes
broadcast                 ``numel``               the root's host                  no / yes, along a chain
========================  ======================  ===============================  =======================

A broadcast's chain is the hosts in the layout's order (each one's first rank)
rotated to start at the root's host: with the root on host 2 of 4, 2 → 3 → 0
→ 1. With two hosts that is the root's host sending to the other, as before.

An average (``ReduceOp.AVG``) is summed on every host and divided once, by the
communicator's size, where the owner reduces the last partial, in the tensor's
dtype as the single-host kernel does (``wire.kernels.reduce``; bfloat16 summed
and divided in float32, rounded once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from emulator.ledger import Posted
from emulator.scheduler import BufferOf, rank_buffers
from wire import kernels
from wire import schema as s
from wire.arena import Arena


@dataclass(frozen=True)
class Layout:
    """Where a communicator's ranks run: its ``hosts`` (in the order of each one's first rank), the host of every
    rank (``host_of[r]``: an index into ``hosts``), and this host's index ``me``."""

    hosts: list[str]
    host_of: list[int]
    me: int

    @property
    def world(self) -> int:
        return len(self.host_of)

    @property
    def mine(self) -> list[int]:
        """The communicator's ranks on this host, in order: the host daemon's members 0, 1, ..."""
        return [r for r, h in enumerate(self.host_of) if h == self.me]


@dataclass(eq=False)  # identity: it holds numpy views
class Share:
    """This host's ranks' buffers for one collective across hosts: typed views, in the order of ``Layout.mine``."""

    req: s.Collective  # the first member's request (its shape, dtype and reduction are every member's)
    posted: list[Posted]
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


def share_of(layout: Layout, posted: list[Posted], arena_of: Callable[[str], Arena], buffer_of: BufferOf) -> Share:
    """Map this host's members' buffers (arenas, or their tensors lent) at the communicator's sizes."""
    req = posted[0].request
    kind = KINDS[req.op]
    if kind.reduces:
        kernels.check_reduce(req.reduce_op, req.dtype)
    size = kernels.itemsize(req.dtype)
    in_n, out_n = kind.sizes(req, layout.world)
    inputs, outputs = [], []
    for q in posted:
        inp, out = rank_buffers(q, in_n * size, out_n * size, arena_of, None, buffer_of)
        inputs.append(kernels.typed(inp, req.dtype))
        outputs.append(inputs[-1] if out is inp else kernels.typed(out, req.dtype))
    return Share(req, posted, inputs, outputs)


class Kind:
    """How one collective op crosses hosts (see the module's table)."""

    reduces = False
    spreads = True

    def sizes(self, req: s.Collective, world: int) -> tuple[int, int]:
        """Elements of each rank's input and output."""
        return req.numel, req.numel

    def units(self, req: s.Collective, world: int) -> int:
        return req.numel

    def pieces(self, layout: Layout, req: s.Collective) -> list[tuple[int, int, int]]:
        """The pieces before chunking: (first unit, end, owner host)."""
        raise NotImplementedError

    def result(self, share: Share, layout: Layout, a: int, b: int) -> np.ndarray | None:
        """Where units [a, b) end up on this host: the first member's output (the others get a copy at the end);
        None where no rank here needs them."""
        return share.outputs[0][a:b]

    def source(self, share: Share, layout: Layout, a: int, b: int) -> np.ndarray:
        """A copying kind's bytes for units [a, b) on their owner."""
        raise NotImplementedError

    def chain(self, layout: Layout, req: s.Collective) -> list[int] | None:
        """A chaining kind's hosts, its one owner first, in the order its result passes along them; None where
        each owner sends its pieces to every other host itself."""
        return None

    def deliver(self, share: Share) -> None:
        """The result into every other member's output on this host."""
        first = share.outputs[0]
        for out in share.outputs[1:]:
            if out is not first:
                out[...] = first


def _segments(numel: int, hosts: int) -> list[tuple[int, int, int]]:
    """Host ``j``'s segment of ``numel`` elements: [lo, hi), every host within one element of the others."""
    return [(numel * j // hosts, numel * (j + 1) // hosts, j) for j in range(hosts)]


class AllReduce(Kind):
    reduces = True

    def pieces(self, layout, req):
        return _segments(req.numel, len(layout.hosts))


class ReduceScatter(Kind):
    reduces = True
    spreads = False

    def sizes(self, req, world):
        if req.out_numel * world != req.numel:
            raise kernels.KernelError(f"reduce_scatter input of {req.numel} elements does not split into {world} x "
                                      f"{req.out_numel}")
        return req.numel, req.out_numel

    def pieces(self, layout, req):
        m = req.out_numel
        return [(r * m, (r + 1) * m, h) for r, h in enumerate(layout.host_of)]

    def result(self, share, layout, a, b):
        m = share.req.out_numel
        r = a // m
        if layout.host_of[r] != layout.me:
            return None
        return share.outputs[layout.mine.index(r)][a - r * m:b - r * m]

    def deliver(self, share):
        """Each piece went straight to its rank's output."""


class AllGather(Kind):
    def sizes(self, req, world):
        return req.numel, req.numel * world

    def units(self, req, world):
        return req.numel * world

    def pieces(self, layout, req):
        n = req.numel
        return [(r * n, (r + 1) * n, h) for r, h in enumerate(layout.host_of)]

    def source(self, share, layout, a, b):
        n = share.req.numel
        r = a // n
        return share.inputs[layout.mine.index(r)][a - r * n:b - r * n]


class Broadcast(Kind):
    def pieces(self, layout, req):
        if not 0 <= req.root < layout.world:
            raise kernels.KernelError(f"root {req.root} is not a rank of this {layout.world}-rank communicator")
        return [(0, req.numel, layout.host_of[req.root])]

    def source(self, share, layout, a, b):
        return share.inputs[layout.mine.index(share.req.root)][a:b]

    def chain(self, layout, req):
        """The layout's hosts from the root's on, wrapping round: each receives from the one before it."""
        first, hosts = layout.host_of[req.root], len(layout.hosts)
        return [(first + k) % hosts for k in range(hosts)]


#: What goes host daemon to host daemon, by op; anything else across hosts stays with the head's daemon.
KINDS: dict[s.CollOp, Kind] = {
    s.CollOp.ALLREDUCE: AllReduce(),
    s.CollOp.REDUCE_SCATTER: ReduceScatter(),
    s.CollOp.ALLGATHER: AllGather(),
    s.CollOp.BROADCAST: Broadcast(),
}
