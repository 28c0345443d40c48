"""A collective across hosts, one host's share: its ranks' part here, pieces exchanged with the other hosts.

Every host daemon of the communicator runs the same plan (:class:`Exchange`)
from the same numbers: the collective's kind (:mod:`emulator.exchange_kinds`:
all-reduce, reduce-scatter, all-gather, broadcast) cuts its units into pieces,
each with an owner host, and each piece into chunks of ``CHUNK_BYTES``. Per
chunk:

1. the owner puts its own ranks' part in the piece's result (a reducing kind:
   their inputs reduced, as the wave scheduler's kernels do; a copying kind:
   its rank's input);
2. a reducing kind's other hosts reduce their ranks over the chunk and send
   that partial to the owner (``PARTIAL``), which, once it has every other
   host's, reduces them with its own;
3. a spreading kind's owner sends the finished chunk to every other host
   (``RESULT``), which opens it straight into its result buffer; a chaining
   kind's (a broadcast's) owner sends it only to the next host of its chain
   (the hosts from the root's on), and each host forwards the bytes it opened
   to the next as each chunk arrives, the last to none.

For an all-reduce that is a reduce-scatter then an all-gather: each host sends
and receives (H − 1)/H of the buffer in each, the bandwidth term of RCCL's ring
between nodes, and since the hosts talk directly (one switch, as the cluster's
bridge) it takes two steps of latency rather than 2(H − 1); for two hosts an
exchange of halves. An all-gather is its second half, a reduce-scatter its
first. Chunks pipeline: a host sends its first partials while it reduces later
chunks, and an owner finishes and sends each chunk as its last partial
arrives. The owner reduces the partials in host order, so a run reduces in
the same order every time (with one rank per host, the head's order), and
every rank of every host receives the same bytes. A broadcast pipelines along
its chain as RCCL's ring broadcast does: the root's host sends the buffer once
rather than to each of the H − 1 others, and every other host receives it once
and (but the last) sends it on once, each chunk as it arrives, so the hosts
pass on the first chunks while later ones are still on their way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from emulator.exchange_kinds import KINDS, Layout, Share
from emulator.peer_seal import Sealed
from wire import kernels
from wire import peers as p
from wire import schema as s

#: Bytes per chunk between hosts: each chunk costs its host daemons about 0.1-0.25 ms of CPU besides its bytes
#: (header, seal and open calls, ZeroMQ's frames and wake-ups), so 4 MiB took 15-20% less CPU than 1 MiB for a
#: 32 MiB all-reduce on 2 and 4 hosts, 256 KiB 60% more, 8 MiB no less (``bench/host_exchange_cpu.py --links``,
#: docs/scaling.md); a 32 MiB all-reduce still pipelines 4 chunks per host pair on 2 hosts. At most
#: ``wire.peers.MAX_PEER_FRAME_BYTES``.
CHUNK_BYTES = 4 << 20
#: Bytes of local reduction and sends per turn of the daemon's loop, so that it keeps reading its links.
TURN_BYTES = 8 << 20
#: Sends a chunk to host ``j`` (an index into the exchange's hosts), its bytes read before it returns.
Send = Callable[[int, p.PeerChunk, np.ndarray], None]


class ExchangeError(Exception):
    """A peer sent what this exchange cannot take (another collective, a chunk off the plan)."""


class Exchange:
    """This host's share of one collective across hosts: its ranks' buffers in ``share``, where everyone runs in
    ``layout``."""

    def __init__(self, share: Share, layout: Layout):
        self.share = share
        self.layout = layout
        self.hosts = layout.hosts
        self.me = me = layout.me
        self.req = req = share.req
        self.kind = kind = KINDS[req.op]
        self.itemsize = kernels.itemsize(req.dtype)
        # an average is summed on every host and divided once, by the communicator's size, on the owner
        self.partial_op = s.ReduceOp.SUM if req.reduce_op is s.ReduceOp.AVG else req.reduce_op
        per = max(1, CHUNK_BYTES // self.itemsize)
        self.others = [j for j in range(len(self.hosts)) if j != me]
        # per owner host, its pieces' chunks: start -> end
        self.chunks: list[dict[int, int]] = [{} for _ in self.hosts]
        for lo, hi, owner in kind.pieces(layout, req):
            self.chunks[owner].update({a: min(a + per, hi) for a in range(lo, hi, per)})
        # local work, each chunk with its owner: a round of every owner's k-th chunk, starting with the next
        # host's, so that the hosts do not all send to the same one at once (a copying kind works only on its own)
        order = [(me + k) % len(self.hosts) for k in range(1, len(self.hosts) + 1)] if kind.reduces else [me]
        starts = [list(c) for c in self.chunks]
        rounds = max(map(len, starts), default=0)
        self.todo = deque((starts[j][k], self.chunks[j][starts[j][k]], j) for k in range(rounds) for j in order
                          if k < len(starts[j]))
        self.done_here: set[int] = set()  # own chunks whose ranks' part is in place
        self.partials: dict[int, dict[int, np.ndarray]] = {}  # own chunk -> host -> its partial
        # a spreading kind's results: from which host come whose pieces' chunks (``sender -> owner``), to which
        # hosts an own chunk goes once finished, and to which a chunk received goes on
        chain = kind.chain(layout, req)
        if chain is None:  # every owner sends to every other host
            self.source, self.spread_to, self.relay_to = {j: j for j in self.others}, self.others, []
        else:  # along the chain: from the host before this one, to the one after (none after the last)
            pos = chain.index(me)
            self.source = {chain[pos - 1]: chain[0]} if pos else {}
            self.spread_to = self.relay_to = chain[pos + 1:pos + 2]
        # per host, chunks still to come from it (own: still to finish); a kind that does not spread sends none
        self.awaiting = [set(c) if j == me else set() for j, c in enumerate(self.chunks)]
        if kind.spreads:
            for j, owner in self.source.items():
                self.awaiting[j] = set(self.chunks[owner])

    @property
    def busy(self) -> bool:
        """Whether local work is left (the loop then polls without sleeping)."""
        return bool(self.todo)

    @property
    def finished(self) -> bool:
        """Every chunk done here, sent, and received: the ranks may have the result."""
        return not self.todo and not any(self.awaiting)

    def waiting_on(self) -> set[int]:
        """The hosts this exchange still needs a chunk from."""
        hosts = {j for j in self.others if self.awaiting[j]}
        if self.kind.reduces:
            for a in self.awaiting[self.me]:
                hosts |= set(self.others) - self.partials.get(a, {}).keys()
        return hosts

    def header(self, phase: p.PeerPhase, a: int, b: int) -> p.PeerChunk:
        req = self.req
        return p.PeerChunk(comm=req.comm, seq=req.seq, phase=phase, op=req.op, reduce_op=req.reduce_op,
                           dtype=req.dtype, numel=req.numel, at=a, count=b - a)

    def advance(self, send: Send) -> None:
        """This host's ranks' part of the chunks, sent on, up to ``TURN_BYTES``."""
        spent = 0
        while self.todo and spent < TURN_BYTES:
            a, b, j = self.todo.popleft()
            spent += (b - a) * self.itemsize
            if j == self.me:
                self._own_part(a, b)
                self.done_here.add(a)
                self._finish_own(a, send)
            else:
                send(j, self.header(p.PeerPhase.PARTIAL, a, b), self._partial(a, b))

    def take(self, j: int, msg: p.PeerChunk, data: Sealed | None, send: Send) -> None:
        """A chunk from host ``j`` (its bytes in ``data``, opened here): a partial of a piece this host owns, or
        a piece ``j`` finished, or along a chain the host before this one forwarded (opened straight into the
        result, and forwarded in turn). :class:`SealError` if they do not open."""
        req = self.req
        if (msg.op, msg.reduce_op, msg.dtype, msg.numel) != (req.op, req.reduce_op, req.dtype, req.numel):
            raise ExchangeError(
                f"host {self.hosts[j]} runs collective #{req.seq} as {msg.op.value} ({msg.reduce_op.value}) of "
                f"{msg.numel} x {msg.dtype}, this host's ranks as {req.op.value} ({req.reduce_op.value}) of "
                f"{req.numel} x {req.dtype}")
        partial = msg.phase is p.PeerPhase.PARTIAL
        owner = self.me if partial else self.source.get(j)  # None: j sends this host no result
        end = None if owner is None else self.chunks[owner].get(msg.at)
        size = 0 if data is None else data.nbytes
        if (end is None or msg.count != end - msg.at or size != msg.count * self.itemsize
                or not (self.kind.reduces if partial else self.kind.spreads)):
            raise ExchangeError(f"host {self.hosts[j]} sent {size} bytes as elements {msg.at}..{msg.at + msg.count} "
                                f"({msg.phase.value}) of collective #{req.seq}, which are not a chunk of its plan")
        if not partial:
            if msg.at not in self.awaiting[j]:
                raise ExchangeError(f"host {self.hosts[j]} sent elements {msg.at}.. of collective #{req.seq} twice")
            out = self.kind.result(self.share, self.layout, msg.at, end)
            data.open(out.view(np.uint8))
            self.awaiting[j].discard(msg.at)
            for k in self.relay_to:  # a chain: the bytes just opened, on to the next host
                send(k, self.header(p.PeerPhase.RESULT, msg.at, end), out)
            return
        got = self.partials.setdefault(msg.at, {})
        if j in got or msg.at not in self.awaiting[self.me]:
            raise ExchangeError(f"host {self.hosts[j]} sent its part of elements {msg.at}.. of collective "
                                f"#{req.seq} twice")
        got[j] = kernels.typed(data.open(), req.dtype)
        self._finish_own(msg.at, send)

    def deliver(self) -> None:
        """The result into every other rank's output on this host."""
        self.kind.deliver(self.share)

    def _reduce_here(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """This host's ranks' inputs over [a, b) reduced into ``out``, or the one input itself."""
        inputs = self.share.inputs
        if len(inputs) == 1:
            return inputs[0][a:b]
        kernels.reduce_into([x[a:b] for x in inputs], self.partial_op, self.req.dtype, out)
        return out

    def _partial(self, a: int, b: int) -> np.ndarray:
        """What this host sends the owner of [a, b): its ranks' reduction (in the result buffer where it has one,
        overwritten by the owner's result later)."""
        out = self.kind.result(self.share, self.layout, a, b)
        if out is None:
            out = np.empty(b - a, self.share.inputs[0].dtype)
        return self._reduce_here(a, b, out)

    def _own_part(self, a: int, b: int) -> None:
        """This host's ranks' part of an own chunk, into its result."""
        out = self.kind.result(self.share, self.layout, a, b)
        src = self._reduce_here(a, b, out) if self.kind.reduces else self.kind.source(self.share, self.layout, a, b)
        if src.__array_interface__["data"][0] != out.__array_interface__["data"][0]:  # in place: already there
            out[...] = src

    def _finish_own(self, a: int, send: Send) -> None:
        """Once an own chunk's part is in place and (reducing) every other host's partial came: reduce them, and
        (spreading) send the result on: to every other host, or to the next of a chain."""
        got = self.partials.get(a, {})
        if a not in self.done_here or (self.kind.reduces and len(got) < len(self.others)):
            return
        b = self.chunks[self.me][a]
        out = self.kind.result(self.share, self.layout, a, b)
        if self.kind.reduces:
            # in host order, this host's partial in its place: with one rank per host (the hosts are in the order
            # of their first ranks) that is the head's order, rank by rank, so a float sum rounds as there
            parts = [out if j == self.me else got[j] for j in range(len(self.hosts))]
            req = self.req
            if self.me <= 1:  # the result may take the first or second part's place, not a later one's
                kernels.reduce_into(parts, req.reduce_op, req.dtype, out, count=self.layout.world)
            else:
                out[...] = kernels.reduce(parts, req.reduce_op, req.dtype, count=self.layout.world)
        self.partials.pop(a, None)
        self.awaiting[self.me].discard(a)
        if self.kind.spreads:
            for j in self.spread_to:
                send(j, self.header(p.PeerPhase.RESULT, a, b), out)
