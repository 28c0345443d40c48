"""The data paths of a communicator: each a transport object that posts a collective and completes it.

In the spirit of PyTorch's OpenReg example, whose process group holds a narrow
transport ("the component vendors replace"): the process group
(``shim/comm/process_group.py``) turns torch's API into a transport-neutral
:class:`Call` and hands it to the transport :func:`path` picks; the transport
posts it to the daemon and returns a :class:`~shim.transport.stream.Pending` that
carries the transport, which later completes it (``shim/transport/stream.py``).

- :class:`ArenaTransport` — shared memory: the inputs are staged in the rank's
  arena (or a staging slot of their own while others are in flight), the
  daemon reduces there; a large tensor all-reduced or broadcast again is not
  copied at all: its storage is lent to the daemon (``shim/transport/shared_buffers.py``).
- :class:`SocketTransport` — NET/Socket (members on different emulated nodes,
  or ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``): the input bytes go as ZeroMQ
  data frames after the request, the output comes back as one after ``Done``.
- :class:`DirectTransport` — small all-reduce, broadcast and barrier on shared
  memory, rank to rank through the ranks' own rings (``shim/transport/direct.py``); the
  daemon, told afterwards, only keeps the books.
- :class:`InProcessTransport` — ``--in-process``: one rank, no daemon.
- ``AcrossHostsTransport`` (``shim/transport/across_hosts.py``) — a communicator across hosts (``--launcher
  slurm``): its all-reduces, reduce-scatters, all-gathers and broadcasts go through this host's daemon over
  shared memory, host daemon to host daemon between hosts; the head's daemon keeps the books.
- ``ShapesTransport`` (``shim/transport/shapes.py``) — estimate mode: tensors without values, the request
  alone.

Which one carries a collective: ``shim/transport/paths.py``.
"""

from __future__ import annotations

import atexit
import dataclasses
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shim.clock import clock
from shim.rank import client as cl
from shim.rank.runtime import RUNTIME
from shim.tensor.wrapper import MirageTensor
from shim.transport import direct, nccl_debug, stream
from shim.transport import shared_buffers as sb
from shim.rank.call_site import call_site
from shim.transport.nccl_errors import nccl_error, watchdog_timeout
from shim.transport.stream import P2PWork, Pending
from wire import kernels
from wire import schema as s
from wire.arena import Arena, arena_name
from wire.collective_timing import Timing, timing


@dataclass
class Comm:
    """One communicator as its transports see it: its identity in the daemon and in c10d, and its clock."""

    id: str  # the daemon's name for it, minted by rank 0 and shared through the store ("" in process)
    rank: int
    size: int
    client: cl.DaemonClient | None
    timeout_s: float  # the group's timeout: the watchdog's deadline (``_set_pg_timeout`` changes it)
    start_stride: tuple[int, int] = (0, 1)  # first global rank and stride, as record_param_comms reports them
    group_name: str = ""
    group_desc: str = ""
    seq: int = 0  # collectives posted so far (point-to-point messages are counted per peer)


@dataclass
class Call:
    """One collective as the process group asks for it, whatever the path."""

    op: s.CollOp
    inputs: list[torch.Tensor]  # the CPU data of the rank's input tensors, in order
    out_numel: int
    dtype: torch.dtype
    deliver: Callable[[torch.Tensor], None] | None = None  # takes the flat output when the work completes
    reduce_op: s.ReduceOp = s.ReduceOp.SUM
    root: int = 0
    device: int | None = None  # the visible ordinal of the GPU it runs on (None: the current device's)
    stage: bool = True  # whether this rank's inputs are sent (a broadcast's non-roots send nothing)
    splits: list[int] = field(default_factory=list)
    numel: int | None = None  # what the daemon matches across ranks (scatter: the share; None: the inputs')
    premul: float | None = None  # premul_sum's factor, applied to the staged copy
    owner: torch.Tensor | None = None  # the emulated tensor whose data is inputs[0], for zero-copy

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = RUNTIME.device.current
        if self.numel is None:
            self.numel = sum(t.numel() for t in self.inputs)

    @property
    def staged_numel(self) -> int:
        return sum(t.numel() for t in self.inputs)

    def request(self, comm: Comm, **fields) -> s.Collective:
        """The daemon's request for this call, with the communicator's next sequence number."""
        comm.seq += 1
        if RUNTIME.clock is not None:  # clocked mode: when this rank's stream lets the collective start
            fields["t_ready"] = RUNTIME.clock.collective_ready(self.device, comm.id)
        return s.Collective(
            comm=comm.id, seq=comm.seq, rank=comm.rank, op=self.op, reduce_op=self.reduce_op,
            dtype=str(self.dtype).removeprefix("torch."), numel=self.numel, out_numel=self.out_numel, root=self.root,
            # the node's GPU, not the visible ordinal: two ranks that each see "cuda:0" through
            # CUDA_VISIBLE_DEVICES are on different GPUs
            device=RUNTIME.device.physical[self.device], site=call_site(), splits=self.splits, **fields,
        )


class Transport:
    """A data path of one communicator: how a collective is posted, and how it completes."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def post(self, call: Call) -> Pending | None:
        """Post ``call`` (stream lock held); None when there is nothing to wait for."""
        raise NotImplementedError

    def complete(self, p: Pending) -> None:
        """Wait for ``p`` (the oldest on the stream, lock held) and deliver its output."""
        raise NotImplementedError

    def ready(self, p: Pending) -> bool:
        """Whether completing ``p`` would not block: the daemon answered."""
        return self.comm.client.poll(p.req)

    def release(self, p: Pending) -> None:
        """``p`` left the stream, completed or failed: let go of what it held."""

    def reply(self, p: Pending) -> s.Reply:
        """The daemon's answer to ``p`` once it comes; an error is raised, a wait past the timeout is the watchdog's."""
        left = self.comm.timeout_s - (time.monotonic() - p.posted_at)
        try:
            reply = self.comm.client.wait(p.req, timeout_s=max(left, 0.001))
        except TimeoutError:
            raise self.watchdog(p.request, time.monotonic() - p.posted_at) from None
        if isinstance(reply, s.Error):
            raise nccl_error(reply.code, reply.message, p.device)
        if isinstance(reply, s.Done) and reply.devices and nccl_debug.enabled():
            nccl_debug.print_init(self.comm.id, self.comm.rank, reply.devices, reply.hosts)
        if RUNTIME.clock is not None and isinstance(reply, s.Done):
            p.t_end = reply.t_end
            self.clocked(p.request, Timing(reply.t_start, reply.t_end, reply.algo), p.device, p.targets)
        return reply

    def clocked(self, request: s.Collective, when: Timing, device: int, outputs) -> None:
        """Clocked mode: the collective ran on the communicator's stream when the daemon says."""
        comm = self.comm
        RUNTIME.clock.collective_done(
            device, comm.id, clock.collective_name(request.op), when.start, when.end,
            {"op": request.op.value, "bytes": request.numel * getattr(torch, request.dtype).itemsize,
             "comm": comm.group_desc or comm.group_name or comm.id, "algo": when.algo, "seq": request.seq,
             "group_size": comm.size},
            outputs,
        )

    def watchdog(self, req: s.Collective, waited_s: float) -> dist.DistBackendError:
        return watchdog_timeout(self.comm.rank, self.comm.timeout_s, req, waited_s)

    def post_p2p(self, request: s.Collective, elem: torch.Tensor, deliver, device: int, tensor) -> P2PWork:
        """Post a send or a receive of ``elem`` (``request`` numbered per peer)."""
        raise NotImplementedError

    def finish_p2p(self, work: P2PWork, timeout_s: float) -> None:
        """Wait for a send or receive and deliver a received message."""
        reply = self.comm.client.wait(work.req, timeout_s)
        if isinstance(reply, s.Error):
            raise nccl_error(reply.code, reply.message, work.device)
        if RUNTIME.clock is not None:
            work.t_end = reply.t_end
            self.clocked(work.request, reply, work.device, work.tensors)
        if work.deliver is not None:
            work.deliver(work.buf)


class InProcessTransport(Transport):
    """``--in-process``: a one-rank group without a daemon; a collective's output is its input."""

    def post(self, call: Call) -> None:
        if call.deliver is not None:
            flat = torch.cat([t.reshape(-1) for t in call.inputs]) if call.inputs else torch.empty(0, dtype=call.dtype)
            call.deliver(flat if call.premul is None else flat * call.premul)
        return None


def _slot_arena(client: cl.DaemonClient, slot: int, nbytes: int) -> Arena:
    """Staging slot ``slot`` (``RUNTIME.staging``, see ``shim.rank.runtime.Staging``), at least ``nbytes``."""
    if slot == 0:
        return client.arena(nbytes)
    staging = RUNTIME.staging
    arena = staging.arenas.get(slot)
    if arena is None or arena.size < nbytes:
        if arena is not None:
            arena.close()
            arena.unlink()
        tag = f"{client.tag}-s{slot}-g{next(staging.generation)}"
        arena = staging.arenas[slot] = Arena.create(arena_name(client.session, tag), max(nbytes, 1 << 20))
    return arena


class ArenaTransport(Transport):
    """Shared memory: the daemon reads the staged inputs and writes the output in a staging slot,
    or works in the rank's own tensor (zero-copy)."""

    def post(self, call: Call) -> Pending:
        return stream.append(self.staged(call, self))

    def staged(self, call: Call, owner: Transport) -> Pending:
        """Stage ``call`` (or lend its tensor) and send its request to this transport's daemon; the pending
        collective is ``owner``'s to complete: this transport, or one that posts through it."""
        client = self.comm.client
        esize = call.dtype.itemsize
        staged_numel = call.staged_numel
        same = call.op in (s.CollOp.ALLREDUCE, s.CollOp.BROADCAST)  # the output is where the input was
        shared = sb.of(client)
        shared.flush()
        zc = None
        deliver, inputs = call.deliver, call.inputs
        if isinstance(call.owner, MirageTensor) and same and call.premul is None and len(inputs) == 1 and (
            deliver is None or getattr(deliver, "targets", [None])[0] is inputs[0]
        ):
            zc = shared.locate(call.owner, inputs[0])
        if zc is not None:  # zero-copy: in place in the rank's tensor, no arena
            slot, name, in_buf, in_off, out_off = -1, "", zc[0], zc[1], zc[1]
            staged, deliver, out_view = inputs[0], None, None
        else:
            out_off = cl.aligned(staged_numel * esize)
            queue = RUNTIME.stream.pending
            slot = 0 if not queue else min(set(range(1, len(queue) + 2)) - RUNTIME.staging.busy)
            arena = _slot_arena(client, slot, out_off + (0 if same else call.out_numel * esize))
            staged = cl.arena_tensor(arena, 0, staged_numel, call.dtype)
            if call.stage:
                at = 0
                for t in inputs:
                    staged[at : at + t.numel()].copy_(t.reshape(-1))
                    at += t.numel()
                if call.premul is not None:
                    staged.mul_(call.premul)
            name, in_buf, in_off, out_off = arena.name, 0, 0, 0 if same else out_off
            out_view = None if same else cl.arena_tensor(arena, out_off, call.out_numel, call.dtype)
        request = call.request(self.comm, arena=name, in_off=in_off, out_off=out_off, in_buf=in_buf, out_buf=in_buf)
        req = client.send(request)
        if slot >= 0:
            RUNTIME.staging.busy.add(slot)
        pending = Pending(owner, request, req, slot, staged, out_view, deliver, call.device, time.monotonic())
        if zc is not None:
            # nothing to deliver, but later collectives touching the tensor wait for this one
            # (it is written while this runs), and the tensor stays alive until then
            pending.targets = [staged]
        return pending

    def complete(self, p: Pending) -> None:
        self.reply(p)
        if p.deliver is not None:
            p.deliver(p.staged if p.out_view is None else p.out_view)

    def release(self, p: Pending) -> None:
        RUNTIME.staging.busy.discard(p.slot)

    def post_p2p(self, request, elem, deliver, device, tensor) -> P2PWork:
        """Each message in a shared-memory buffer of its own, which the daemon copies between the peers."""
        client = self.comm.client
        arena = client.scratch(elem.numel() * elem.element_size())
        buf = cl.arena_tensor(arena, 0, elem.numel(), elem.dtype)
        if request.op is s.CollOp.SEND:
            buf.copy_(elem.reshape(-1))
        request = dataclasses.replace(request, arena=arena.name)
        req = client.send(request)
        return P2PWork(self, req, arena, buf, deliver, device, [tensor], request)


def _payload(inputs: list[torch.Tensor], premul: float | None) -> memoryview | None:
    """The bytes a socket-transport collective sends: its inputs in order (one input as it is, not copied)."""
    if not sum(t.numel() for t in inputs):
        return None
    if len(inputs) == 1 and premul is None:
        flat = inputs[0].detach().reshape(-1)
    else:
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        if premul is not None:
            flat.mul_(premul)
    return memoryview(flat.view(torch.uint8).numpy())


def _received(data: memoryview | None, numel: int, dtype: str) -> torch.Tensor:
    """A socket-transport output as a flat tensor over the frame the daemon sent back (checked against its size)."""
    dt = getattr(torch, dtype)
    got = 0 if data is None else len(data)
    if got != numel * dt.itemsize:
        raise dist.DistBackendError(
            f"mirage: the daemon sent {got} bytes for an output of {numel} x {dtype} ({numel * dt.itemsize} bytes)"
        )
    return torch.frombuffer(data, dtype=dt) if numel else torch.empty(0, dtype=dt)


class SocketTransport(Transport):
    """NET/Socket: the inputs go as data frames after the request, the output comes back as one after ``Done``."""

    def post(self, call: Call) -> Pending:
        request = call.request(self.comm, transport=s.Transport.SOCKET)
        req = self.comm.client.send(request, _payload(call.inputs, call.premul) if call.stage else None)
        # a broadcast's root gets nothing back (its output is its input), so it delivers that
        own = (call.inputs[0].reshape(-1)
               if call.op is s.CollOp.BROADCAST and self.comm.rank == call.root and call.inputs else None)
        return stream.append(Pending(self, request, req, None, own, None, call.deliver, call.device, time.monotonic()))

    def complete(self, p: Pending) -> None:
        self.reply(p)
        data = self.comm.client.data(p.req)  # taken even when nothing is delivered: it goes with the reply
        if p.deliver is not None:
            p.deliver(p.staged if p.staged is not None else _received(data, p.request.out_numel, p.request.dtype))

    def post_p2p(self, request, elem, deliver, device, tensor) -> P2PWork:
        """The message travels as a data frame, to the daemon and back."""
        payload = _payload([elem], None) if request.op is s.CollOp.SEND else None
        request = dataclasses.replace(request, transport=s.Transport.SOCKET)
        req = self.comm.client.send(request, payload)
        return P2PWork(self, req, None, None, deliver, device, [tensor], request)

    def finish_p2p(self, work: P2PWork, timeout_s: float) -> None:
        reply = self.comm.client.wait(work.req, timeout_s)
        if isinstance(reply, s.Error):
            raise nccl_error(reply.code, reply.message, work.device)
        if RUNTIME.clock is not None:
            work.t_end = reply.t_end
            self.clocked(work.request, reply, work.device, work.tensors)
        data = self.comm.client.data(work.req)  # a receive's message came with the reply
        if work.deliver is not None:
            t = work.tensors[0]
            work.deliver(_received(data, t.numel(), str(t.dtype).removeprefix("torch.")))


class DirectTransport(Transport):
    """Rank to rank (``shim.transport.direct``): the input goes into this rank's ring, the request to the daemon,
    which answers only if something is wrong; completing reads the peers' rings."""

    def __init__(self, comm: Comm):
        super().__init__(comm)
        self.rings: direct.PeerRings | None = None  # made at the first collective that goes this way

    def takes(self, call: Call) -> bool:
        """Whether ``call`` may go rank to rank (never a communicator's first collective: that one
        connects it, and NCCL checks its GPUs then)."""
        return bool(self.comm.seq) and direct.eligible(
            call.op, call.staged_numel * call.dtype.itemsize, str(call.dtype).removeprefix("torch."), call.reduce_op)

    def post(self, call: Call) -> Pending:
        comm = self.comm
        rings = self.rings
        if rings is None:
            try:
                rings = self.rings = direct.PeerRings(comm.client.session, comm.id, comm.rank, comm.size)
            except direct.RingError as e:
                raise dist.DistBackendError(str(e)) from None
        index = rings.posted + 1
        numel = call.staged_numel
        request = call.request(comm, direct=True)
        if not rings.slot_free(index):
            # its last user must be done on every rank: here first (in order, as on a stream), then the peers
            last = [p for p in RUNTIME.stream.pending if p.transport is self and 0 < p.ring <= index - direct.SLOTS]
            if last:
                stream.complete_through(last[-1])
            deadline = time.monotonic() + comm.timeout_s
            while not rings.slot_free(index):
                if time.monotonic() > deadline:
                    raise self.watchdog(request, comm.timeout_s)
                time.sleep(0.0002)
                comm.client.check_daemon()

        data = None  # what this rank sends: its input (one tensor: all-reduce, broadcast), as bytes
        inputs = call.inputs
        if numel and (call.op is not s.CollOp.BROADCAST or comm.rank == call.root):
            t = inputs[0].reshape(-1) if len(inputs) == 1 else torch.cat([t.reshape(-1) for t in inputs])
            data = (t if call.premul is None else t * call.premul).view(torch.uint8).numpy().data

        pending = Pending(self, request, 0, None, None, None, call.deliver, call.device, time.monotonic())
        pending.ring = rings.post(request.seq, call.op, request.dtype, numel, call.reduce_op, call.root, data,
                                  request.t_ready)
        pending.req = comm.client.defer(request)
        return stream.append(pending)

    def ready(self, p: Pending) -> bool:
        """Every peer posted (or the daemon answered: with an error)."""
        return self.rings.arrived(p.ring) or self.comm.client.poll(p.req)

    def complete(self, p: Pending) -> None:
        """Wait for every peer, then reduce or copy their inputs."""
        rings, req, client = self.rings, p.request, self.comm.client
        deadline = p.posted_at + self.comm.timeout_s

        def check() -> None:  # between waits: the daemon must know this rank waits, and may have answered
            client.flush()
            if client.poll(p.req):  # the daemon answers only with an error
                self.reply(p)
            client.check_daemon()

        if not rings.wait(p.ring, deadline, check):
            raise self.watchdog(req, time.monotonic() - p.posted_at)
        if not rings.matches(p.ring):
            # the ranks disagree on what they run: the daemon sees it too, and its error names both sides
            client.flush()
            self.reply(p)
            raise dist.DistBackendError(f"mirage: collective #{req.seq} differs between ranks")
        dtype = getattr(torch, req.dtype)
        nbytes = req.numel * dtype.itemsize
        if req.op is s.CollOp.ALLREDUCE and req.numel:
            # one tensor (``_into``'s target: contiguous, not any rank's slot) is reduced into straight
            one = len(p.targets) == 1
            out = p.targets[0].reshape(-1) if one else torch.empty(req.numel, dtype=dtype)
            parts = [kernels.typed(x, req.dtype) for x in rings.inputs(p.ring, nbytes)]
            kernels.reduce_into(parts, req.reduce_op, req.dtype, kernels.typed(out.view(torch.uint8).numpy(), req.dtype))
            if not one:
                p.deliver(out)
        elif req.op is s.CollOp.BROADCAST and p.deliver is not None:
            p.deliver(torch.from_numpy(rings.inputs(p.ring, nbytes)[req.root]).view(dtype))
        if RUNTIME.clock is not None:  # timed as the daemon times it: one host, every member's t_ready known
            when = timing(RUNTIME.clock.profile, req, self.comm.size, self.comm.size, rings.start_time(p.ring))
            p.t_end = when.end
            self.clocked(req, when, p.device, p.targets)
        rings.finish(p.ring)
        client.forget(p.req)


@dataclass(frozen=True)
class Route:
    """Which daemon serves a communicator, and over which data path."""

    path: str  # "shm" or "socket"
    client: cl.DaemonClient
    # members on several hosts (a multi-host run): their hosts, in the order of each one's first rank, the
    # communicator's ranks on this host, and each rank's host (an index into ``hosts``); else empty
    hosts: tuple[str, ...] = ()
    here: tuple[int, ...] = ()
    host_of: tuple[int, ...] = ()


def route(store: dist.Store, comm: str, rank: int, size: int, node: str) -> Route:
    """The communicator's daemon and data path, the path chosen as RCCL chooses its transport (``nccl_debug``).

    ``"socket"`` (NET/Socket: ZeroMQ frames) with P2P and SHM both disabled,
    when a member runs on another emulated node (``node``: its NCCL_HOSTID), or
    when the daemon is on another host (reached over TCP: no memory to share
    with it); else ``"shm"``. In a multi-host run, a communicator whose members
    all run on this host is served by this host's daemon (``RUNTIME.host_client``),
    as on one machine; one across hosts by the head's, over the socket, and the
    route then names the hosts and this host's members (the head's daemon may
    keep only the books while the hosts' daemons carry the data:
    ``shim/transport/across_hosts.py``). Only a multi-node run has to ask where
    the members are: each rank writes its node and host to the store and reads
    everyone's, as NCCL's bootstrap all-gathers them.
    """
    head, here = RUNTIME.client(), RUNTIME.host_client()
    over_tcp = not (RUNTIME.settings.endpoint or "ipc://").startswith("ipc://")
    if size == 1 or here is None and RUNTIME.settings.num_nodes <= 1:
        daemon = head if here is None else here
        return Route("socket" if nccl_debug.net_only() or daemon is head and over_tcp else "shm", daemon)
    store.set(f"mirage_host/{comm}/{rank}", f"{node}\n{socket.gethostname()}")
    members = [v.decode().split("\n") for v in store.multi_get([f"mirage_host/{comm}/{r}" for r in range(size)])]
    one_node = all(n == node for n, _ in members) and not nccl_debug.net_only()
    me = socket.gethostname()
    if here is not None and all(h == me for _, h in members):
        return Route("shm" if one_node else "socket", here)
    if here is None:
        return Route("shm" if one_node and not over_tcp else "socket", head)
    hosts = tuple(dict.fromkeys(h for _, h in members))
    return Route("socket", head, hosts, tuple(r for r, (_, h) in enumerate(members) if h == me),
                 tuple(hosts.index(h) for _, h in members))


@atexit.register
def _at_exit() -> None:
    """At exit: complete what the process posted and never waited for, then remove its staging buffers.

    A peer's collective reads this rank's inputs from these buffers (and from
    the storages it lent, and its rings) when the peer posts it, maybe after
    this process is gone. A process ending on an uncaught exception does not
    wait (NCCL aborts its communicators then); its peers' collectives fail.
    """
    if RUNTIME.stream.pending and not hasattr(sys, "last_value"):
        try:
            stream.drain()
        except Exception as e:  # noqa: BLE001 - the exit goes on; the collective's error is the news
            print(f"mirage: at exit, a collective posted and never waited for failed: {str(e).splitlines()[0]}",
                  file=sys.stderr, flush=True)
        RUNTIME.flush_clients()  # the books of rank-to-rank collectives completed just now
    for arena in RUNTIME.staging.arenas.values():
        arena.unlink()
