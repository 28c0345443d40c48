"""A communicator across hosts: its collectives' data goes host daemon to host daemon, the head keeping the books.

In a multi-host run a communicator whose members span hosts is the head's
daemon's (``transports.route``): its books — every rank's arrival, sequence
and shape, the hang and desync checks, the events every reader folds — are
kept there. The bytes of its all-reduces, reduce-scatters, all-gathers and
broadcasts need not go there: as RCCL reduces inside a node and crosses the
network between nodes, :class:`AcrossHostsTransport` hands each one to this
host's daemon over shared memory (staged in the rank's
arena, or its own tensor lent: :class:`~shim.transport.transports.ArenaTransport`,
as a communicator inside the host), whose share of the communicator holds this
host's members only; the host daemons reduce (or gather) their members and
exchange the pieces among themselves (``emulator/across_hosts.py``,
``emulator/exchange_kinds.py``). The head's daemon
gets the same request without data (``Transport.HOSTS``): it matches it with
the other ranks' and publishes it, and answers only when something is wrong —
a hang, a desync, a dead peer — which the rank watches for while it waits.

Only what every rank decides alike takes this path (so both daemons' orders
agree): those four collectives, of a dtype the kernels know, whose input or output
holds at least ``MIRAGE_ACROSS_HOSTS_MIN_BYTES`` (256 KiB: below it the head's one
round trip costs less than the host daemons' exchange, 1.2 against 3.6 ms for a
4 KiB all-reduce on 2 hosts, docs/scaling.md), never a communicator's first collective (which connects it: its
devices are checked and ``NCCL_DEBUG`` prints its rings from the head's answer),
in functional mode (clocked time needs every rank's readiness, which only the
head's daemon has). The rest goes the communicator's own way, to the head's daemon.
"""

from __future__ import annotations

import time

from shim.rank import client as cl
from shim.rank.runtime import RUNTIME
from shim.transport import nccl_debug, stream
from shim.transport.nccl_errors import nccl_error
from shim.transport.stream import Pending
from shim.transport.transports import ArenaTransport, Call, Comm, Route, Transport
from wire import kernels
from wire import schema as s

#: What goes host daemon to host daemon (``emulator/exchange_kinds.py``: ``KINDS``).
OPS = (s.CollOp.ALLREDUCE, s.CollOp.REDUCE_SCATTER, s.CollOp.ALLGATHER, s.CollOp.BROADCAST)
#: How often a rank waiting on its host's daemon looks for an error from the head's.
BOOKS_CHECK_S = 0.05


class AcrossHostsTransport(Transport):
    """The head's books (``comm``: the head's daemon) and this host's share of the data (``part``: this host's
    daemon, the communicator's members here numbered among themselves)."""

    def __init__(self, comm: Comm, part: Comm):
        super().__init__(comm)
        self.part = ArenaTransport(part)

    def takes(self, call: Call) -> bool:
        """Whether ``call`` goes host daemon to host daemon (every rank answers alike: see the module)."""
        size = max(call.staged_numel, call.out_numel) * call.dtype.itemsize  # the collective's, every rank's alike
        return (bool(self.comm.seq) and call.op in OPS
                and size >= max(RUNTIME.settings.across_hosts_min_bytes, 1)
                and str(call.dtype).removeprefix("torch.") in kernels.DTYPES)

    def post(self, call: Call) -> Pending:
        books = call.request(self.comm, transport=s.Transport.HOSTS)
        self.part.comm.seq = books.seq - 1  # the share numbers it as the books do: errors name one number
        pending = self.part.staged(call, self)
        pending.books = self.comm.client.send(books)
        return stream.append(pending)

    def ready(self, p: Pending) -> bool:
        return self.part.comm.client.poll(p.req) or self.comm.client.poll(p.books)

    def complete(self, p: Pending) -> None:
        """Wait for this host's daemon, watching the head's for an error; then deliver as on shared memory."""
        host, head = self.part.comm.client, self.comm.client
        deadline = p.posted_at + self.comm.timeout_s
        while True:
            try:
                reply = host.wait(p.req, timeout_s=max(0.001, min(BOOKS_CHECK_S, deadline - time.monotonic())))
                break
            except TimeoutError:
                pass
            if head.poll(p.books):
                books = head.wait(p.books, 0.001)
                if isinstance(books, s.Error):
                    raise nccl_error(books.code, books.message, p.device)
            head.check_daemon()
            if time.monotonic() > deadline:
                raise self.watchdog(p.request, time.monotonic() - p.posted_at)
        if isinstance(reply, s.Error):
            raise nccl_error(reply.code, reply.message, p.device)
        if p.deliver is not None:
            p.deliver(p.staged if p.out_view is None else p.out_view)

    def release(self, p: Pending) -> None:
        self.part.release(p)


def share(comm: Comm, route: Route, client: cl.DaemonClient, init: s.CommInit) -> AcrossHostsTransport | None:
    """Join this host's daemon's share of ``comm`` (its members here, ``route.here``, of those on ``route.hosts``)
    and return the transport that carries its collectives that way; None where the run keeps them with the
    head's daemon (clocked or estimate mode, or P2P and SHM disabled). ``init`` is the rank's ``CommInit`` to
    the head."""
    if RUNTIME.settings.clocked or RUNTIME.settings.estimate or nccl_debug.net_only():
        return None
    here = route.here
    part = Comm(comm.id, here.index(comm.rank), len(here), client, comm.timeout_s, comm.start_stride,
                group_name=comm.group_name, group_desc=comm.group_desc)
    reply = client.request(s.CommInit(comm=comm.id, rank=part.rank, size=part.size, global_rank=init.global_rank,
                                      node=init.node, host=init.host, transport="shm", name=init.name,
                                      desc=init.desc, hosts=list(route.hosts), host_of=list(route.host_of)))
    if isinstance(reply, s.Error):
        raise nccl_error(reply.code, reply.message, RUNTIME.device.current)
    return AcrossHostsTransport(comm, part)
