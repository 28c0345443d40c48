"""A host daemon's share of the communicators across hosts: its own ranks' posts, and the exchanges they start.

In a multi-host run a communicator whose members span hosts keeps its books in
the head's daemon (every rank's arrival, sequence and shape: ``Transport.HOSTS``),
while the data of its all-reduces, reduce-scatters, all-gathers and broadcasts
goes host daemon to host daemon, as RCCL's goes node to node. Each host daemon
serves its own members over shared memory, exactly as a communicator inside the
host (arenas, zero-copy), and holds them here: a ledger of its own, in which the
members are numbered among themselves and which the hang detector never reads
(the head's ledger names the ranks, once), and the communicator's layout (which
host each rank runs on). When every member on this host has posted collective
``seq``, its buffers become an :class:`~emulator.host_exchange.Exchange` with
the other hosts' daemons (:mod:`emulator.peer_links`), of the kind its op names
(:mod:`emulator.exchange_kinds`); once it is done every member gets ``Done``.

Nothing here publishes events: the head's daemon does, for the whole communicator.
A failure answers this host's waiting members with the error, which names the host.
"""

from __future__ import annotations

from collections.abc import Callable

from emulator.exchange_kinds import KINDS, Layout, share_of
from emulator.host_exchange import Exchange, ExchangeError
from emulator.ledger import CommError, Communicator, Ledger, Posted
from emulator.peer_links import SILENCE_S, PeerLinks
from emulator.peer_seal import SealError
from emulator.scheduler import BufferOf
from wire import peers as p
from wire import schema as s
from wire.arena import Arena
from wire.kernels import DTYPES


class AcrossHosts:
    """This host's members of the communicators across hosts, and their exchanges in flight."""

    def __init__(self, links: PeerLinks | None, arena_of: Callable[[str], Arena], buffer_of: BufferOf,
                 reply: Callable[[bytes, s.Reply], None]):
        self.links = links  # None: not a host daemon of a multi-host run, so no communicator across hosts
        self.arena_of = arena_of
        self.buffer_of = buffer_of
        self.reply = reply
        self.parts = Ledger()  # this host's members only, numbered among themselves
        self.layouts: dict[str, Layout] = {}  # communicator -> where its members run
        self.running: dict[tuple[str, int], Exchange] = {}  # (communicator, seq) -> its exchange
        # chunks that came before this host's members posted their collective: (comm, seq) -> [(chunk, its bytes)]
        self.early: dict[tuple[str, int], list[tuple[p.PeerChunk, object]]] = {}

    def owns(self, comm: str) -> bool:
        return comm in self.layouts

    @property
    def busy(self) -> bool:
        """Whether an exchange has local work left (the loop then polls without sleeping)."""
        return any(ex.busy for ex in self.running.values())

    def join(self, init: s.CommInit) -> None:
        """A member on this host joins its communicator's share here."""
        links = self.links
        if links is None:
            raise CommError("ncclInvalidUsage", f"communicator {init.comm} spans hosts {init.hosts}, and this daemon "
                                                "has no links to other hosts' daemons")
        if links.host not in init.hosts or len(set(init.hosts)) != len(init.hosts):
            raise CommError("ncclInvalidUsage", f"communicator {init.comm} spans hosts {init.hosts}, which must name "
                                                f"this daemon's host {links.host} once")
        unknown = [h for h in init.hosts if not links.knows(h)]
        if unknown:
            raise CommError("ncclInvalidUsage", f"communicator {init.comm} spans hosts {init.hosts}, and this daemon "
                                                f"has no link to {', '.join(unknown)}")
        me = init.hosts.index(links.host)
        if sorted(set(init.host_of)) != list(range(len(init.hosts))) or init.host_of.count(me) != init.size:
            raise CommError("ncclInvalidUsage", f"communicator {init.comm} places its ranks on hosts {init.host_of} "
                                                f"of {init.hosts}, which must use every host and put {init.size} on "
                                                f"{links.host}")
        layout = Layout(list(init.hosts), list(init.host_of), me)
        if self.layouts.setdefault(init.comm, layout) != layout:
            raise CommError("ncclInvalidUsage", f"rank {init.global_rank} joined communicator {init.comm} over hosts "
                                                f"{init.hosts} ({init.host_of}), its other members here over "
                                                f"{self.layouts[init.comm].hosts} ({self.layouts[init.comm].host_of})")
        self.parts.join(init)

    def post(self, client: bytes, req: s.Collective) -> None:
        """A member's collective; once every member here posted it, its exchange with the other hosts starts."""
        if req.op not in KINDS or req.dtype not in DTYPES or req.direct or req.transport is not s.Transport.SHM:
            raise CommError("ncclInvalidArgument", f"{req.op.value} ({req.reduce_op.value}) of {req.dtype} cannot go "
                                                   "host daemon to host daemon")
        try:
            comm, matched = self.parts.post(client, req)
        except CommError as e:
            comm = self.parts.comms.get(req.comm)
            if comm is None or comm.failed is e:
                raise
            return self.fail(comm, e, [Posted(client, req)])
        if matched is None:
            return
        layout = self.layouts[req.comm]
        try:
            ex = Exchange(share_of(layout, matched, self.arena_of, self.buffer_of), layout)
        except (ValueError, OSError) as e:  # an arena or buffer that will not map, a kernel refusing
            return self.fail(comm, CommError("ncclInvalidArgument", str(e)), matched)
        key = (req.comm, req.seq)
        self.running[key] = ex
        for msg, data in self.early.pop(key, []):
            self.take(ex, msg, data)

    def on_peer(self, msg: p.PeerMessage, data) -> None:
        """A message from another host's daemon: a chunk goes to its exchange (kept if that has not started)."""
        if not isinstance(msg, p.PeerChunk):
            return  # a beat: the links noted when the host was heard from
        comm = self.parts.comms.get(msg.comm)
        if comm is not None and comm.failed:
            return
        key = (msg.comm, msg.seq)
        ex = self.running.get(key)
        if ex is None:
            self.early.setdefault(key, []).append((msg, data))
            return
        self.take(ex, msg, data)

    def take(self, ex: Exchange, msg: p.PeerChunk, data) -> None:
        """A chunk for ``ex`` from another host; a chunk off its plan fails the communicator here."""
        if msg.host not in ex.hosts or msg.host == self.links.host:
            return self.links.refuse(f"a chunk of communicator {msg.comm} from {msg.host!r}, not another of its hosts")
        try:
            ex.take(ex.hosts.index(msg.host), msg, data, self.send)
        except ExchangeError as e:
            return self.fail(self.parts.comms[msg.comm], CommError("ncclInvalidUsage", str(e)), [])
        except SealError as e:  # its header opened, its bytes did not: altered on the way
            return self.fail(self.parts.comms[msg.comm], CommError(
                "ncclRemoteError", f"a chunk from host {msg.host} of collective #{msg.seq}: {e}"), [])
        self.finish_if_done(ex)

    def send(self, j: int, msg: p.PeerChunk, data) -> None:
        self.links.send(self.layouts[msg.comm].hosts[j], msg, data)

    def advance(self) -> None:
        """Local work of the exchanges in flight, a turn's worth each; the finished ones answer their ranks."""
        for ex in list(self.running.values()):
            if ex.busy:
                ex.advance(self.send)
            self.finish_if_done(ex)

    def finish_if_done(self, ex: Exchange) -> None:
        if not ex.finished:
            return
        req = ex.req
        if self.running.pop((req.comm, req.seq), None) is None:
            return
        ex.deliver()
        self.parts.complete(self.parts.comms[req.comm], req.seq)
        for posted in ex.share.posted:
            self.reply(posted.client, s.Done(req=posted.request.req, comm=req.comm, seq=req.seq))

    def check(self, now: float) -> None:
        """Fail the exchanges still waiting on a host whose daemon has been silent for ``SILENCE_S``."""
        for ex in list(self.running.values()):
            silent = sorted((self.links.silent_for(ex.hosts[j], now), ex.hosts[j]) for j in ex.waiting_on())
            if silent and silent[-1][0] > SILENCE_S:
                waited, host = silent[-1]
                comm = self.parts.comms[ex.req.comm]
                ranks = ", ".join(str(comm.members[q.request.rank].global_rank) for q in ex.share.posted)
                self.fail(comm, CommError(
                    "ncclRemoteError", f"host {host}'s daemon has not been heard from for {waited:.1f} s while ranks "
                                       f"{{{ranks}}} on {self.links.host} wait in collective #{ex.req.seq}"), [])

    def fail(self, comm: Communicator, err: CommError, extra: list[Posted]) -> None:
        """This host's share of ``comm`` failed: every member waiting here gets the error."""
        waiting = self.parts.fail(comm, err) + extra
        for key in [k for k in self.running if k[0] == comm.comm]:
            waiting += self.running.pop(key).share.posted
        for key in [k for k in self.early if k[0] == comm.comm]:
            del self.early[key]
        for q in waiting:
            self.reply(q.client, s.Error(req=q.request.req, code=err.code, message=err.message))
