"""The emulator daemon: one per session, owner of the emulated GPUs' collectives.

Single-threaded on purpose: one loop polls the ZeroMQ ROUTER socket and the fast
socket (:mod:`emulator.fast_socket`), feeds each request (:meth:`Daemon.handle`)
to the ledger, and between polls runs one wave of the scheduler
(:meth:`Daemon.run_wave`), whose finished jobs become replies and events
(:meth:`Daemon.finish`). No locks, and the order in which things happen is the
order events are published.

Sockets are ``ipc://`` files in the session's 0700 run directory; every request
must carry the session token; anything malformed gets an ``Error`` reply and a
``ProtocolError`` event, never an exception out of the loop. A multi-host run
(``--listen ADDR``) also takes ranks over TCP on that one address, encrypted
with CURVE (:func:`listen_tcp`); the daemon then checks only its own host's
processes, and hears of another host's from the session (``RankExited``).

Over 600 lines on purpose: the loop, the request dispatch and a job's finish
are one sequence of steps a reader follows top to bottom; what stands on its own
lives beside it (the fast socket, ledger, scheduler, kernels, hang and straggler
detection, the collective clock).
"""

from __future__ import annotations

import hmac
import os
import resource
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import numpy as np
import zmq

from emulator.buffers import RankBuffers
from emulator.collective_clock import CollectiveClock
from emulator.events import EventPublisher
from emulator.fast_socket import FastSocketServer, is_fast
from emulator.hang import HangDetector
from emulator.ledger import CommError, Communicator, Ledger, Posted, Worlds
from emulator.lifetime import die_with_parent, orphaned, stop_orphans
from emulator.payloads import Payload, SocketPayloads, from_frames
from emulator.ranks import RankProcesses
from emulator.scheduler import Job, WaveScheduler, make_job, make_p2p_job
from emulator.straggler import StragglerDetector
from wire import schema as s
from wire.arena import Arena, ArenaError, check_name
from wire.collective_timing import Timing
from wire.endpoints import TCP_ENDPOINT_FILE, endpoints
from wire.kernels import DTYPES, KernelError, itemsize
from wire.profiles import load_profile

#: How often progress events go out for one collective, at most.
PROGRESS_INTERVAL_S = 0.05
HANG_SCAN_INTERVAL_S = 0.1
PEER_CHECK_INTERVAL_S = 0.02
#: Refused requests written to daemon.log one by one; after that, one line per thousand.
REFUSALS_LOGGED = 20
#: Largest communicator: mirage's largest cluster (1024 nodes x 64 GPUs).
MAX_COMM_SIZE = 1 << 16
#: what a MemoryReport passes on, unchanged, as a MemoryUsage event
_MEMORY_FIELDS = ("rank", "node", "device", "allocated", "reserved", "peak", "total")
#: what a StepReport passes on, unchanged, as a ClockedStep event
_STEP_FIELDS = ("rank", "node", "step", "t_start", "t_end", "compute_s", "comm_s", "exposed_comm_s", "ops",
                "bytes_only_ops")
#: a functional-mode job's place in emulated time: none
_UNTIMED = Timing(0.0, 0.0, "")
#: Frames above this are cut off by ZeroMQ (the connection is dropped) before they are buffered;
#: request frames between ``schema.MAX_MESSAGE_BYTES`` and this get an error reply. Data frames
#: (the socket transport) may be this big.
MAX_FRAME_BYTES = s.MAX_DATA_FRAME_BYTES
#: What CURVE adds to a message on the wire (its MESSAGE command, nonce, flags and MAC: 33 bytes), rounded up.
CURVE_BOX_BYTES = 64
ONE_FRAME = "malformed request: expected one frame (data frames follow only a socket-transport collective)"


def listen_tcp(sock: zmq.Socket, address: str, secret_key_file: str) -> str:
    """Bind ``sock`` (already bound to its ``ipc://`` endpoint) on ``tcp://address`` too, as a CURVE server.

    libzmq copies a socket's options into each listener when it binds, so the
    ``ipc://`` endpoint keeps the NULL mechanism (the run directory's 0700 guards
    it) and only the TCP one, which crosses the network, is encrypted: the
    session token inside every request never travels in clear. The secret key
    comes from a 0600 file of the run directory; clients need only the public
    key (``zmq.curve_public``) and make their own key pair. Returns the bound
    endpoint (its port chosen by the kernel).
    """
    with open(secret_key_file, "rb") as f:
        secret = f.read().strip()
    # libzmq checks a message's size as it arrives, and over CURVE that is the box around it: a full data
    # frame is bigger there than its bytes, and the daemon's limit would drop the rank's connection, its
    # collective lost with it (the frames' sizes are checked exactly once decrypted, in ``payloads.from_frames``)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + CURVE_BOX_BYTES)
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    sock.curve_server = True
    sock.bind(f"tcp://{address}:0")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class Daemon:
    """Serves one session until stopped (SIGTERM, or its parent going away)."""

    def __init__(self, run_dir: str, session: str, token: str, profile: str, nodes: int, gpus_per_node: int,
                 hang_timeout_s: float = 30.0, exec_mode: str = "functional", listen: str = "",
                 secret_key_file: str = ""):
        self.session = session
        self.token = token
        self._token_bytes = token.encode()
        self.profile = profile
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.exec_mode = exec_mode
        # clocked mode: each collective's place in emulated time (None: functional mode, no clock)
        self.clock = CollectiveClock(load_profile(profile)) if exec_mode == "clocked" else None
        # two I/O threads: socket-transport frames from and to different ranks move in parallel (one
        # thread moves about 1.5 GB/s through a unix socket here; two halved a 32 MiB all-reduce's time)
        self.ctx = zmq.Context(io_threads=2)
        rpc, events = endpoints(run_dir)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # a vanished client must not make replies block the loop
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a 4 GiB frame must not be buffered
        self.router.bind(rpc)
        if listen:  # ranks on other hosts (--launcher slurm): the endpoint goes to the session in a file
            tcp = listen_tcp(self.router, listen, secret_key_file)
            with open(os.path.join(run_dir, TCP_ENDPOINT_FILE), "w") as f:
                f.write(tcp)
        self.events = EventPublisher(self.ctx, events)
        self.buffers = RankBuffers()  # tensors ranks registered, mapped (zero-copy collectives)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        # ranks' requests without data frames, one datagram each (see emulator/fast_socket.py)
        self.fast = FastSocketServer(run_dir, self.poller, on_request=self.handle,
                                     on_refuse=lambda client, why: self.refuse(client, 0, why),
                                     on_drop=self.buffers.drop)  # a rank's buffers never outlive its connection
        self.ledger = Ledger()
        self.worlds = Worlds()  # init_process_group calls waiting for their peers
        self.scheduler = WaveScheduler()
        self.hangs = HangDetector(hang_timeout_s)
        self.stragglers = StragglerDetector()
        self.ranks = RankProcesses(socket.gethostname())  # which process is each rank, and is it alive
        self.arenas: dict[str, Arena] = {}
        self.payloads = SocketPayloads()  # socket-transport inputs received and not yet consumed
        self.running = True
        self.refused = 0  # requests refused so far (bad token, malformed)

    # ------------------------------------------------------------ plumbing

    def reply(self, client: bytes, msg: s.Reply, data: np.ndarray | None = None) -> None:
        """Send ``msg`` to ``client``; ``data`` (a socket-transport output) follows as one frame, not copied."""
        if is_fast(client):
            return self.fast.reply(client, msg)  # never with data: socket-transport requests use ZeroMQ
        try:
            if data is None:
                self.router.send_multipart([client, s.encode(msg)], zmq.NOBLOCK)
            else:
                # ranks accept frames of any size (only the daemon's side has a limit); ZeroMQ keeps a
                # reference to the buffer until it is sent, so the job may go away
                self.router.send_multipart([client, s.encode(msg), data], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # the client is gone; its rank will be reported dead by the session

    def arena(self, name: str) -> Arena:
        arena = self.arenas.get(name)
        if arena is None:
            check_name(name, self.session)
            # a rank that grew its arena unlinked the old generation: let go of our mapping too
            owner = name.rsplit("-g", 1)[0] + "-g"
            for old in [n for n in self.arenas if n.startswith(owner)]:
                self.arenas.pop(old).close()
            arena = self.arenas[name] = Arena.open(name)
        return arena

    # ------------------------------------------------------------ requests

    def handle(self, client: bytes, data: bytes, fds: Sequence[int] = (), frames: Sequence[zmq.Frame] = ()) -> None:
        """Answer one request; ``fds`` came with it (fast socket), ``frames`` after it (socket-transport
        collectives, over ZeroMQ).

        :meth:`admit` decodes and authenticates it, then its type's handler in
        :data:`_HANDLERS` runs; whatever a handler raises becomes the rank's
        ``Error`` reply, never an exception out of the loop.
        """
        admitted = self.admit(client, data, frames)
        if admitted is None:
            return
        msg, payload = admitted
        try:
            handler = _HANDLERS.get(type(msg))
            if handler is None:
                self.refuse(client, msg.req, f"unexpected request {msg.TYPE!r}")
            else:
                handler(self, client, msg, fds, payload)
        except CommError as e:
            self.reply(client, s.Error(req=msg.req, code=e.code, message=e.message))
        except (ArenaError, KernelError, OSError) as e:
            self.reply(client, s.Error(req=msg.req, code="ncclInvalidArgument", message=str(e)))
        except Exception as e:  # a bug must not take the session's GPUs down, nor leave a rank waiting
            traceback.print_exc()
            self.reply(client, s.Error(req=msg.req, code="ncclInternalError", message=f"daemon internal error: {e}"))

    def admit(self, client: bytes, data: bytes, frames: Sequence[zmq.Frame]) -> tuple[s.Request, Payload | None] | None:
        """Framing and authentication: the request in ``data`` with its data frames' bytes, or None once refused.

        Data frames may follow only a socket-transport collective, every request
        must carry the session token, and the frames must be whole (see
        :func:`emulator.payloads.from_frames`); anything else is refused before any handler sees it.
        """
        try:
            msg = s.decode(data)
        except s.SchemaError as e:
            self.refuse(client, 0, ONE_FRAME if frames else f"malformed request: {e}")
            return None
        with_frames = isinstance(msg, s.Collective) and msg.transport is s.Transport.SOCKET
        if frames and not with_frames:
            self.refuse(client, msg.req if isinstance(msg, s.Request) else 0, ONE_FRAME)
            return None
        if not isinstance(msg, s.Request):
            self.refuse(client, 0, f"{msg.TYPE!r} is not a request")
            return None
        # surrogatepass: JSON may carry a lone surrogate ("\ud800"), which strict utf-8 refuses
        if not hmac.compare_digest(msg.token.encode("utf-8", "surrogatepass"), self._token_bytes):
            self.refuse(client, msg.req, "unauthorized: wrong or missing session token")
            return None
        why, payload = from_frames(frames) if with_frames else ("", None)
        if why:
            self.refuse(client, msg.req, f"malformed request: {why}")
            return None
        return msg, payload

    # One handler per request type, all called as ``handler(client, msg, fds, payload)`` (see _HANDLERS);
    # each answers its rank (``Ok``, unless said otherwise) and raises what becomes an ``Error`` reply.

    def _collective(self, client: bytes, msg: s.Collective, fds: Sequence[int], payload: Payload | None) -> None:
        """A collective or a point-to-point half, posted to the ledger; answered when it completes."""
        if msg.op is s.CollOp.SEND or msg.op is s.CollOp.RECV:
            self.post_p2p(client, msg, payload)
        else:
            self.post(client, msg, payload)

    def _ping(self, client: bytes, msg: s.Ping, fds: Sequence[int], payload: Payload | None) -> None:
        """The session's readiness probe: ``daemon_ready`` again, for a subscriber that joined late."""
        self.reply(client, s.Ok(req=msg.req))
        self.publish_ready()

    def _hello(self, client: bytes, msg: s.Hello, fds: Sequence[int], payload: Payload | None) -> None:
        """A rank's process registers; the last registration of a rank is the one watched."""
        self.reply(client, s.Ok(req=msg.req))
        self.ranks.register(msg.rank, msg.pid, msg.host)
        self.events.publish(s.RankRegistered(rank=msg.rank, node=msg.node, pid=msg.pid, host=msg.host))

    def _rank_exited(self, client: bytes, msg: s.RankExited, fds: Sequence[int], payload: Payload | None) -> None:
        """The session says a process of another host exited (this daemon cannot see it)."""
        self.reply(client, s.Ok(req=msg.req))
        if self.ranks.exited_elsewhere(msg.rank, msg.pid, msg.host):
            self.rank_gone(msg.rank, f"rank {msg.rank} (pid {msg.pid} on {msg.host}) exited")

    def _world_formation(self, client: bytes, msg: s.WorldFormation, fds: Sequence[int],
                         payload: Payload | None) -> None:
        """A rank enters or leaves ``init_process_group``: recorded for the hang scan of worlds."""
        if not 1 <= msg.size <= MAX_COMM_SIZE or not 0 <= msg.rank < msg.size:
            raise CommError("ncclInvalidArgument", f"rank {msg.rank} outside a world of size {msg.size}")
        self.worlds.record(msg, self.ranks.alive)
        self.reply(client, s.Ok(req=msg.req))
        self.events.publish(s.WorldStage(world=msg.world, rank=msg.rank, size=msg.size, site=msg.site,
                                         phase=msg.phase))

    def _compile_state(self, client: bytes, msg: s.CompileState, fds: Sequence[int], payload: Payload | None) -> None:
        """A rank starts or stops compiling: its peers' waits meanwhile are not hangs."""
        self.hangs.pause(msg.rank, "compiling", msg.compiling)
        self.reply(client, s.Ok(req=msg.req))

    def _debugger_state(self, client: bytes, msg: s.DebuggerState, fds: Sequence[int],
                        payload: Payload | None) -> None:
        """A rank stops in or runs on from its debugger (``--debug-rank``): no hang while it is stopped."""
        self.ranks.debugging(msg.rank, msg.pid)
        self.hangs.debugger(msg.rank, stopped=msg.phase is not s.DebugPhase.RUNNING)
        self.reply(client, s.Ok(req=msg.req))
        self.events.publish(s.RankDebugging(rank=msg.rank, node=msg.node, pid=msg.pid, phase=msg.phase,
                                            debugger=msg.debugger, address=msg.address, connect=msg.connect))

    def _step_report(self, client: bytes, msg: s.StepReport, fds: Sequence[int], payload: Payload | None) -> None:
        """A clocked step's books, passed on as an event; unanswered: the rank does not wait for them."""
        self.events.publish(s.ClockedStep(**{f: getattr(msg, f) for f in _STEP_FIELDS}))

    def _memory_report(self, client: bytes, msg: s.MemoryReport, fds: Sequence[int],
                       payload: Payload | None) -> None:
        """A GPU's memory figures, passed on as an event."""
        self.reply(client, s.Ok(req=msg.req))
        self.events.publish(s.MemoryUsage(**{f: getattr(msg, f) for f in _MEMORY_FIELDS}))

    def _comm_init(self, client: bytes, msg: s.CommInit, fds: Sequence[int], payload: Payload | None) -> None:
        """A rank joins a communicator."""
        if not 1 <= msg.size <= MAX_COMM_SIZE:  # the ledger and the hang scan walk every rank
            raise CommError("ncclInvalidArgument", f"communicator size {msg.size} is outside 1..{MAX_COMM_SIZE}")
        self.ledger.join(msg)
        self.reply(client, s.Ok(req=msg.req))
        self.events.publish(
            s.CommJoined(
                comm=msg.comm, rank=msg.rank, size=msg.size, global_rank=msg.global_rank,
                transport=msg.transport, name=msg.name, desc=msg.desc,
            )
        )

    def _register_buffer(self, client: bytes, msg: s.RegisterBuffer, fds: Sequence[int],
                         payload: Payload | None) -> None:
        """A rank lends a tensor's storage (the descriptor in ``fds``) for zero-copy collectives."""
        self.buffers.register(client, msg.buf, msg.nbytes, list(fds))
        self.reply(client, s.Ok(req=msg.req))

    def _release_buffers(self, client: bytes, msg: s.ReleaseBuffers, fds: Sequence[int],
                         payload: Payload | None) -> None:
        """A rank's lent storages died: unmap them."""
        self.buffers.release(client, msg.bufs)
        self.reply(client, s.Ok(req=msg.req))

    def refuse(self, client: bytes, req: int, why: str) -> None:
        self.reply(client, s.Error(req=req, code="protocol", message=why))
        self.events.publish(s.ProtocolError(message=why))
        # daemon.log too: the first refusals with their reason, then one line per thousand (a flood stays small)
        self.refused += 1
        if self.refused <= REFUSALS_LOGGED or self.refused % 1000 == 0:
            print(f"mirage daemon: refused request #{self.refused} from client {client.hex()}: {why[:200]}",
                  file=sys.stderr, flush=True)

    def publish_ready(self) -> None:
        self.events.publish(
            s.DaemonReady(pid=os.getpid(), profile=self.profile, nodes=self.nodes, gpus_per_node=self.gpus_per_node,
                          exec_mode=self.exec_mode)
        )

    def post_p2p(self, client: bytes, req: s.Collective, payload: Payload | None) -> None:
        """A send or receive; the copy runs in the scheduler once both halves are posted."""
        try:
            self.payloads.hold(client, req, payload, self.ledger.comms.get(req.comm))
            comm, pair = self.ledger.post_p2p(client, req)
        except (CommError, KernelError) as e:
            self.payloads.discard(client, req)
            return self.refuse_post(client, req, _comm_error(e))
        if pair is not None:
            try:
                job = make_p2p_job(comm, pair, self.arena, self.payloads.take)
                job.timing = self.timing(comm, pair)
                self.scheduler.submit(job)
            except (ArenaError, KernelError, OSError) as e:
                self.fail(comm, CommError("ncclInvalidArgument", str(e)), extra=pair)

    def post(self, client: bytes, req: s.Collective, payload: Payload | None) -> None:
        if not 0 <= req.device < self.gpus_per_node:
            err = CommError(
                "ncclInvalidArgument", f"device {req.device} is not one of this node's {self.gpus_per_node} GPUs"
            )
            return self.refuse_post(client, req, err)
        if req.direct and (req.op not in s.DIRECT_OPS or req.transport is not s.Transport.SHM or req.dtype not in DTYPES):
            err = CommError("ncclInvalidArgument",
                            f"{req.op.value} of {req.dtype} over {req.transport.value} cannot go rank to rank")
            return self.refuse_post(client, req, err)
        try:
            self.payloads.hold(client, req, payload, self.ledger.comms.get(req.comm))
            comm, matched = self.ledger.post(client, req)
        except (CommError, KernelError) as e:
            self.payloads.discard(client, req)
            return self.refuse_post(client, req, _comm_error(e))
        # published once the ledger took it: a refused post was never enqueued
        self.events.publish_enqueued(req)
        if matched is None:
            return
        warning = self.stragglers.observe(comm, matched)
        if warning is not None and warning.rank not in self.ranks.debugged:
            self.events.publish(warning)
        if req.direct:  # the ranks moved the data themselves: only the books to keep, nobody to answer
            self.ledger.complete(comm, req.seq)
            nbytes = 0 if req.op is s.CollOp.BARRIER else req.numel * itemsize(req.dtype)
            self.events.publish(s.CollectiveStarted(comm=comm.comm, seq=req.seq, op=req.op, total_bytes=nbytes))
            # clocked: the time every rank computed for itself from the same t_ready and figures
            t = self.timing(comm, matched) or _UNTIMED
            self.events.publish(s.CollectiveCompleted(comm=comm.comm, seq=req.seq, op=req.op, total_bytes=nbytes,
                                                      seconds=0.0, emulated_start=t.start, emulated_end=t.end,
                                                      algo=t.algo))
            return
        try:
            job = make_job(comm, matched, self.arena, self.payloads.take, self.buffers.view)
        except (ArenaError, KernelError, OSError) as e:
            return self.fail(comm, CommError("ncclInvalidArgument", str(e)), extra=matched)
        job.timing = self.timing(comm, matched)
        self.scheduler.submit(job)
        self.events.publish(s.CollectiveStarted(comm=comm.comm, seq=req.seq, op=req.op, total_bytes=job.total_bytes))

    def timing(self, comm: Communicator, posted: list[Posted]) -> Timing | None:
        """Clocked mode: the matched posts' place in emulated time; functional mode: None, no clock."""
        return self.clock.time(comm, posted) if self.clock is not None else None

    def refuse_post(self, client: bytes, req: s.Collective, err: CommError) -> None:
        """A post the ledger will not take: its communicator fails (every rank waiting in it hears why)."""
        comm = self.ledger.comms.get(req.comm)
        if comm is None or comm.failed is err:
            raise err  # answered by handle(): nobody else is waiting on it
        self.fail(comm, err, extra=[Posted(client, req)])

    def fail(self, comm: Communicator, err: CommError, extra: list[Posted]) -> None:
        """Fail the communicator: every rank waiting in it gets the error."""
        self.payloads.drop(comm.comm)  # nobody will run on the bytes its ranks sent
        waiting = self.ledger.fail(comm, err) + extra
        waiting += [p for job in self.scheduler.drop(comm) for p in job.posted]
        for p in waiting:
            self.reply(p.client, s.Error(req=p.request.req, code=err.code, message=err.message))
        self.events.publish(s.CommFailed(comm=comm.comm, code=err.code, message=err.message))

    def rank_gone(self, rank: int, how: str) -> None:
        """``rank``'s process is gone: the books say how, and the session hears of it."""
        self.events.publish(s.RankGone(rank=rank, pid=self.ranks.gone(rank, how)))

    def check_peers(self) -> None:
        """Notice ranks whose process is gone, and fail the collectives waiting on them."""
        for rank, pid in self.ranks.exited():
            self.rank_gone(rank, f"rank {rank} (pid {pid}) exited")
        for rank in self.ranks.left_debugger():  # its peers' waits are hangs (or failures) again
            self.hangs.debugger(rank, stopped=False)
        dead = self.ranks.dead
        for comm in self.ledger.comms.values():
            if comm.failed or not comm.posted:
                continue  # an idle communicator of a finished rank is fine until someone posts to it
            gone = [g for m in comm.members.values() if (g := m.global_rank) in dead]
            seq = min(comm.posted)
            waiting = sorted(
                g for r in comm.posted[seq] if (g := comm.members[r].global_rank) not in dead
            )
            if gone and waiting:  # nobody alive waiting (a teardown): nothing to tell
                joined = {comm.members[r].global_rank for r in comm.posted[seq]}
                culprit = min(gone, key=lambda g: g in joined)  # one that never came, if any
                waiters = ", ".join(map(str, waiting))
                err = CommError(
                    "ncclRemoteError", f"{dead[culprit]} while ranks {{{waiters}}} wait in collective #{seq}"
                )
                self.fail(comm, err, extra=[])

    # ------------------------------------------------------------ execution

    def run_wave(self) -> None:
        progressed, finished = self.scheduler.run_wave()
        now = time.monotonic()
        for job in progressed:
            if job.done >= job.total or now - job.last_progress < PROGRESS_INTERVAL_S:
                continue
            job.last_progress = now
            req = job.first
            self.events.publish(
                s.CollectiveProgress(
                    comm=req.comm, seq=req.seq, done_bytes=job.done * job.itemsize, total_bytes=job.total_bytes
                )
            )
        for job in finished:
            self.finish(job)

    def finish(self, job: Job) -> None:
        req = job.first
        if job.error is not None:
            traceback.print_exception(job.error)
            err = CommError("ncclInternalError", f"collective #{req.seq} ({req.op.value}) failed in the emulator: {job.error}")
            return self.fail(job.comm, err, extra=job.posted)
        t = job.timing or _UNTIMED
        if req.op is s.CollOp.SEND:  # point-to-point: no collective sequence to advance
            for p, out in zip(job.posted, job.outputs):
                self.reply(p.client, s.Done(req=p.request.req, comm=req.comm, seq=req.seq, t_start=t.start,
                                            t_end=t.end, algo=t.algo), _sent_back(p, out))
                scratch = self.arenas.pop(p.request.arena, None)  # one buffer per message: done with it
                if scratch is not None:
                    scratch.close()
            return
        self.ledger.complete(job.comm, req.seq)
        first = req.seq == 1
        devices = [p.request.device for p in job.posted] if first else []
        hosts = [job.comm.members[p.request.rank].host for p in job.posted] if first else []
        for p, out in zip(job.posted, job.outputs):
            # a broadcast's root has its output already: it is the input it sent
            back = None if req.op is s.CollOp.BROADCAST and p.request.rank == req.root else _sent_back(p, out)
            self.reply(p.client, s.Done(req=p.request.req, comm=req.comm, seq=req.seq, devices=devices, hosts=hosts,
                                        t_start=t.start, t_end=t.end, algo=t.algo), back)
        self.events.publish(
            s.CollectiveCompleted(
                comm=req.comm, seq=req.seq, op=req.op, total_bytes=job.total_bytes,
                seconds=time.monotonic() - job.started, emulated_start=t.start, emulated_end=t.end, algo=t.algo,
            )
        )

    def serve(self) -> None:
        """The loop: take requests, run a wave, repeat; exits when ``running`` drops."""
        parent = os.getppid()
        next_scan = next_peer_check = 0.0
        self.publish_ready()
        while self.running:
            # queued events wake the loop up to go out even if nothing else happens
            wait_s = 0.0 if self.scheduler.busy else self.events.wait_s(PEER_CHECK_INTERVAL_S)
            ready = dict(self.poller.poll(wait_s * 1000))
            for sock, flags in ready.items():
                if sock is not self.router:
                    self.fast.ready(sock, flags)
            if self.router in ready:
                self.read_router()
            if self.scheduler.busy:
                self.run_wave()
            now = time.monotonic()
            if now >= next_peer_check:  # often: the first rank to go is the one to name
                next_peer_check = now + PEER_CHECK_INTERVAL_S
                self.check_peers()
            if now >= next_scan:  # cheap, but not on every busy iteration
                next_scan = now + HANG_SCAN_INTERVAL_S
                self.scan_hangs(now)
            self.events.flush(force=False)
            if orphaned(parent):
                break  # the session is gone: nobody is left to serve

    def read_router(self) -> None:
        """Handle the requests waiting on the ZeroMQ socket, each with the data frames that follow it."""
        for _ in range(256):  # bounded, so waves keep running under load
            try:
                client = self.router.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not self.router.get(zmq.RCVMORE):
                self.refuse(client, 0, ONE_FRAME)
                continue
            request = self.router.recv()
            data = []  # a socket-transport collective's bytes: kept as ZeroMQ received them, not copied
            while self.router.get(zmq.RCVMORE):
                data.append(self.router.recv(copy=False))
            self.handle(client, request, frames=data)

    def scan_hangs(self, now: float) -> None:
        """Publish what the hang detector finds in the ledger and in the worlds being formed."""
        # ranks whose collective is running in the scheduler: waiting for the daemon, not for a peer
        busy = frozenset(
            job.comm.members[p.request.rank].global_rank for job in self.scheduler.jobs for p in job.posted
        )
        for finding in self.hangs.scan(self.ledger, now, busy):
            self.events.publish(finding)
        for finding in self.hangs.scan_worlds(self.worlds, self.ranks.alive, now):
            self.events.publish(finding)

    def stop_orphans(self) -> None:
        """The session is gone: stop the ranks it left (they would wait on nobody) and remove its arenas."""
        # another host's ranks are its agent's to stop (it stops them once the session stops answering)
        stop_orphans(self.session, self.ranks.local_pids())

    def close(self) -> None:
        self.events.close()
        for arena in self.arenas.values():
            arena.close()
        self.buffers.close()
        self.fast.close()
        self.router.close(0)
        self.ctx.term()


#: The handler of each request type (see Daemon.handle): every request of the catalogue has one.
_HANDLERS: dict[type[s.Request], Callable[[Daemon, bytes, s.Request, Sequence[int], Payload | None], None]] = {
    s.Collective: Daemon._collective,  # one per rank per collective; the rest are rare
    s.Ping: Daemon._ping,
    s.Hello: Daemon._hello,
    s.RankExited: Daemon._rank_exited,
    s.WorldFormation: Daemon._world_formation,
    s.CompileState: Daemon._compile_state,
    s.DebuggerState: Daemon._debugger_state,
    s.StepReport: Daemon._step_report,
    s.MemoryReport: Daemon._memory_report,
    s.CommInit: Daemon._comm_init,
    s.RegisterBuffer: Daemon._register_buffer,
    s.ReleaseBuffers: Daemon._release_buffers,
}


def _sent_back(p: Posted, out: np.ndarray) -> np.ndarray | None:
    """What goes back to the rank after ``Done``: a socket-transport rank's output, if it has one."""
    return out if p.request.transport is s.Transport.SOCKET and out.size else None


def _comm_error(e: CommError | KernelError) -> CommError:
    return e if isinstance(e, CommError) else CommError("ncclInvalidArgument", str(e))


def run(run_dir: str, session: str, token: str, profile: str, nodes: int, gpus_per_node: int,
        hang_timeout_s: float, exec_mode: str = "functional", listen: str = "", secret_key_file: str = "") -> int:
    """Entry point used by ``python -m emulator``."""
    parent = os.getppid()
    die_with_parent()
    daemon = Daemon(run_dir, session, token, profile, nodes, gpus_per_node, hang_timeout_s, exec_mode, listen,
                    secret_key_file)

    def stop(signum, frame):
        daemon.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"mirage daemon pid {os.getpid()} serving {endpoints(run_dir)[0]}", file=sys.stderr, flush=True)
    try:
        daemon.serve()
    finally:
        if orphaned(parent):  # the session died without stopping us (SIGKILL): nobody else will clean up
            daemon.stop_orphans()
        daemon.close()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        # read by bench/allreduce_perf.py: what the collectives cost the daemon
        print(f"mirage daemon exiting; cpu seconds: {usage.ru_utime + usage.ru_stime:.3f}", file=sys.stderr, flush=True)
    return 0
