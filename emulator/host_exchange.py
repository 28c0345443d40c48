"""An all-reduce across hosts, one host's share: reduce its ranks here, exchange segments with the other hosts.

Every host daemon of the communicator runs the same plan (:class:`Exchange`)
from the same numbers: the ``numel`` elements are cut into one segment per host
(host ``j`` owns segment ``j``) and each segment into chunks of ``CHUNK_BYTES``.
Per chunk:

1. the host's own ranks' inputs are reduced into its result buffer (the first
   rank's output, as the wave scheduler's all-reduce does);
2. a chunk of another host's segment goes to that host (``PARTIAL``);
3. a segment's owner, once it has every other host's partial of a chunk,
   reduces them with its own and sends the result to every other host
   (``REDUCED``), which copies it into its result buffer.

That is a reduce-scatter then an all-gather: each host sends and receives
(H − 1)/H of the buffer in each, the bandwidth term of RCCL's ring between
nodes, and since the hosts talk directly (one switch, as the cluster's bridge)
it takes two steps of latency rather than 2(H − 1). For two hosts it is an
exchange of halves. Chunks pipeline: a host sends its first partials while it
reduces later chunks, and an owner reduces and sends each chunk as its last
partial arrives. The owner reduces its own partial first, then the others' in
host order, so a run sums in the same order every time, and every rank of
every host receives the same bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from emulator.peer_seal import Sealed
from emulator.scheduler import Job
from wire import kernels
from wire import peers as p

#: Bytes per chunk between hosts: large enough that a chunk's header, its Python and its seal cost little
#: beside its bytes, small enough that the hosts' links are busy both ways from the first chunks (1, 2 and
#: 4 MiB measured alike here, within the noise of a shared box). At most ``wire.peers.MAX_PEER_FRAME_BYTES``.
CHUNK_BYTES = 1 << 20
#: Bytes of local reduction and sends per turn of the daemon's loop, so that it keeps reading its links.
TURN_BYTES = 8 << 20
#: Sends a chunk to host ``j`` (an index into the exchange's hosts), its bytes read before it returns.
Send = Callable[[int, p.PeerChunk, np.ndarray], None]


class ExchangeError(Exception):
    """A peer sent what this exchange cannot take (another collective, a chunk off the plan)."""


def segments(numel: int, hosts: int) -> list[tuple[int, int]]:
    """Host ``j``'s segment of ``numel`` elements: [lo, hi), every host within one element of the others."""
    return [(numel * j // hosts, numel * (j + 1) // hosts) for j in range(hosts)]


class Exchange:
    """This host's share of one all-reduce across ``hosts`` (it is ``hosts[me]``), its ranks' buffers in ``job``."""

    def __init__(self, job: Job, hosts: list[str], me: int):
        self.job = job
        self.hosts = hosts
        self.me = me
        req = job.first
        self.req = req
        self.out = job.targets[0]  # the result, reduced here first (the first rank's output)
        self.itemsize = job.itemsize
        per = max(1, CHUNK_BYTES // job.itemsize)
        self.others = [j for j in range(len(hosts)) if j != me]
        # per host, its segment's chunks: start -> end
        self.chunks = [{a: min(a + per, hi) for a in range(lo, hi, per)} for lo, hi in segments(req.numel, len(hosts))]
        # local reductions to do, each chunk with where it goes: a round of every host's k-th chunk, starting
        # with the next host's, so that the hosts do not all send to the same one at once
        order = [(me + k) % len(hosts) for k in range(1, len(hosts) + 1)]
        starts = [list(c) for c in self.chunks]
        rounds = max(map(len, starts), default=0)
        self.todo = deque((starts[j][k], self.chunks[j][starts[j][k]], j) for k in range(rounds) for j in order
                          if k < len(starts[j]))
        self.reduced_here: set[int] = set()  # own chunks whose ranks' reduction is done
        self.partials: dict[int, dict[int, np.ndarray]] = {}  # own chunk -> host -> its partial
        self.awaiting = [set(c) for c in self.chunks]  # per host, chunks still to come (own: still to finish)

    @property
    def busy(self) -> bool:
        """Whether local work is left (the loop then polls without sleeping)."""
        return bool(self.todo)

    @property
    def finished(self) -> bool:
        """Every chunk reduced here, sent, and received: the ranks may have the result."""
        return not self.todo and not any(self.awaiting)

    def waiting_on(self) -> set[int]:
        """The hosts this exchange still needs a chunk from."""
        hosts = {j for j in self.others if self.awaiting[j]}
        for a in self.awaiting[self.me]:
            hosts |= set(self.others) - self.partials.get(a, {}).keys()
        return hosts

    def header(self, phase: p.PeerPhase, a: int, b: int) -> p.PeerChunk:
        req = self.req
        return p.PeerChunk(comm=req.comm, seq=req.seq, phase=phase, op=req.op, reduce_op=req.reduce_op,
                           dtype=req.dtype, numel=req.numel, at=a, count=b - a)

    def advance(self, send: Send) -> None:
        """Reduce this host's ranks' chunks and send them on, up to ``TURN_BYTES``."""
        spent = 0
        while self.todo and spent < TURN_BYTES:
            a, b, j = self.todo.popleft()
            self._reduce_here(a, b)
            spent += (b - a) * self.itemsize
            if j == self.me:
                self.reduced_here.add(a)
                self._finish_own(a, send)
            else:
                send(j, self.header(p.PeerPhase.PARTIAL, a, b), self.out[a:b])

    def take(self, j: int, msg: p.PeerChunk, data: Sealed | None, send: Send) -> None:
        """A chunk from host ``j`` (its bytes in ``data``, opened here): a partial of this host's segment, or
        another segment's result (opened straight into the result). :class:`SealError` if they do not open."""
        req = self.req
        if (msg.op, msg.reduce_op, msg.dtype, msg.numel) != (req.op, req.reduce_op, req.dtype, req.numel):
            raise ExchangeError(
                f"host {self.hosts[j]} runs collective #{req.seq} as {msg.op.value} ({msg.reduce_op.value}) of "
                f"{msg.numel} x {msg.dtype}, this host's ranks as {req.op.value} ({req.reduce_op.value}) of "
                f"{req.numel} x {req.dtype}")
        owner = self.me if msg.phase is p.PeerPhase.PARTIAL else j
        end = self.chunks[owner].get(msg.at)
        size = 0 if data is None else data.nbytes
        if end is None or msg.count != end - msg.at or size != msg.count * self.itemsize:
            raise ExchangeError(f"host {self.hosts[j]} sent {size} bytes as elements {msg.at}..{msg.at + msg.count} "
                                f"({msg.phase.value}) of collective #{req.seq}, which are not a chunk of its plan")
        if msg.phase is p.PeerPhase.REDUCED:
            if msg.at not in self.awaiting[j]:
                raise ExchangeError(f"host {self.hosts[j]} sent elements {msg.at}.. of collective #{req.seq} twice")
            data.open(self.out[msg.at:end].view(np.uint8))
            self.awaiting[j].discard(msg.at)
            return
        got = self.partials.setdefault(msg.at, {})
        if j in got or msg.at not in self.awaiting[self.me]:
            raise ExchangeError(f"host {self.hosts[j]} sent its part of elements {msg.at}.. of collective "
                                f"#{req.seq} twice")
        got[j] = kernels.typed(data.open(), req.dtype)
        self._finish_own(msg.at, send)

    def deliver(self) -> None:
        """The result into every other rank's output on this host."""
        for out in self.job.targets[1:]:
            out[...] = self.out

    def _reduce_here(self, a: int, b: int) -> None:
        inputs = self.job.inputs
        if len(inputs) == 1:
            if inputs[0] is not self.out:  # in place (the rank's own tensor, or its arena): nothing to do
                self.out[a:b] = inputs[0][a:b]
            return
        kernels.reduce_into([x[a:b] for x in inputs], self.req.reduce_op, self.req.dtype, self.out[a:b])

    def _finish_own(self, a: int, send: Send) -> None:
        """Reduce an own chunk with the other hosts' partials, once all are here, and send the result to them."""
        got = self.partials.get(a, {})
        if a not in self.reduced_here or len(got) < len(self.others):
            return
        b = self.chunks[self.me][a]
        out = self.out[a:b]
        if got:
            kernels.reduce_into([out] + [got[j] for j in sorted(got)], self.req.reduce_op, self.req.dtype, out)
        self.partials.pop(a, None)
        self.awaiting[self.me].discard(a)
        for j in self.others:
            send(j, self.header(p.PeerPhase.REDUCED, a, b), out)
