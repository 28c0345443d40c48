"""The emulator daemon: one per session, owner of the emulated GPUs' collectives.

Single-threaded on purpose: one loop (:meth:`Daemon.serve`) polls the ZeroMQ
ROUTER socket and the fast socket (:mod:`emulator.fast_socket`) and answers each
request (:meth:`Daemon.handle`: framing and authentication first, in
:meth:`Daemon.admit`, then the handler of the request's type, from
:data:`_HANDLERS`); between polls it runs one wave of the scheduler
(:meth:`emulator.collectives.Collectives.run_wave`), whose finished jobs become
replies and events. No locks, and the order in which things happen is the
order events are published.

Sockets are ``ipc://`` files in the session's 0700 run directory; every request
must carry the session token; anything malformed gets an ``Error`` reply and a
``ProtocolError`` event, never an exception out of the loop. A multi-host run
(``--listen ADDR``) also takes ranks over TCP on that one address, encrypted
with CURVE (:func:`listen_tcp`); the daemon then checks only its own host's
processes, and hears of another host's from the session (``RankExited``).
A host's daemon in such a run (``--peer-listen ADDR``) also links to the
other hosts' daemons (:mod:`emulator.peer_links`), with which it runs the
data of communicators across hosts, its own members' share
(:mod:`emulator.across_hosts`), while the head's daemon keeps their books.

The daemon is the server: sockets, loop, one small handler per request. Each
concern it serves is an object it owns: the collectives
(:mod:`emulator.collectives`: ledger, scheduler, arenas, lent buffers, socket
bytes), the rank processes (:mod:`emulator.ranks`), the events going out
(:mod:`emulator.events`), hang detection (:mod:`emulator.hang`).
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

from emulator.across_hosts import AcrossHosts
from emulator.collective_clock import CollectiveClock
from emulator.collectives import Collectives
from emulator.events import EventPublisher
from emulator.fast_socket import FastSocketServer, is_fast
from emulator.hang import HangDetector
from emulator.ledger import CommError, Worlds
from emulator.lifetime import die_with_parent, orphaned, stop_orphans
from emulator.payloads import Payload, from_frames
from emulator.peer_links import PeerLinks, PeerLinksError
from emulator.ranks import RankProcesses
from wire import schema as s
from wire.arena import ArenaError
from wire.endpoints import TCP_ENDPOINT_FILE, endpoints
from wire.kernels import KernelError
from wire.profiles import load_profile

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
                 secret_key_file: str = "", peer_listen: str = ""):
        self.session = session
        self.token = token
        self._token_bytes = token.encode()
        self.profile = profile
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.exec_mode = exec_mode
        # clocked mode: each collective's place in emulated time (None: functional mode, no clock)
        clock = CollectiveClock(load_profile(profile)) if exec_mode in ("clocked", "estimate") else None
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
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.ranks = RankProcesses(socket.gethostname(),  # which process is each rank; its pidfd wakes the loop
                                   watch=lambda fd: self.poller.register(fd, zmq.POLLIN), unwatch=self.poller.unregister)
        self.collectives = Collectives(session, gpus_per_node, clock, self.events, self.reply, self.ranks)
        # a host's daemon in a multi-host run: links to the other hosts' daemons, for communicators across hosts
        self.links = None
        if peer_listen:
            try:
                self.links = PeerLinks(self.ctx, socket.gethostname(), token, peer_listen)
            except PeerLinksError as e:  # its ranks' groups across hosts then fail when made, saying why
                print(f"mirage daemon: no links to other hosts' daemons: {e}", file=sys.stderr, flush=True)
        if self.links is not None:
            self.poller.register(self.links.router, zmq.POLLIN)
        self.across = AcrossHosts(self.links, self.collectives.arena, self.collectives.buffers.view, self.reply)
        # ranks' requests without data frames, one datagram each (see emulator/fast_socket.py)
        self.fast = FastSocketServer(run_dir, self.poller, on_request=self.handle,
                                     on_refuse=lambda client, why: self.refuse(client, 0, why),
                                     # a rank's buffers never outlive its connection
                                     on_drop=self.collectives.buffers.drop)
        self.worlds = Worlds()  # init_process_group calls waiting for their peers
        self.hangs = HangDetector(hang_timeout_s)
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
        :func:`emulator.payloads.from_frames`); anything else is refused before
        any handler sees it.
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
        if self.across.owns(msg.comm):  # this host's share of a communicator across hosts
            return self.across.post(client, msg)
        if msg.op is s.CollOp.SEND or msg.op is s.CollOp.RECV:
            self.collectives.post_p2p(client, msg, payload)
        else:
            self.collectives.post(client, msg, payload)

    def _ping(self, client: bytes, msg: s.Ping, fds: Sequence[int], payload: Payload | None) -> None:
        """The session's readiness probe: ``daemon_ready`` again, for a subscriber that joined late."""
        self.reply(client, s.Ok(req=msg.req))
        self.publish_ready()

    def _hello(self, client: bytes, msg: s.Hello, fds: Sequence[int], payload: Payload | None) -> None:
        """A rank's process registers; the last registration of a rank is the one watched."""
        self.reply(client, s.Ok(req=msg.req))
        self.ranks.register(msg.rank, msg.pid, msg.host)
        self.events.publish(s.RankRegistered(rank=msg.rank, node=msg.node, pid=msg.pid, host=msg.host,
                                             launched_pid=msg.launched_pid))

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
        """A rank starts or stops compiling: its peers' waits meanwhile are not hangs, and the console says so."""
        self.hangs.pause(msg.rank, "compiling", msg.compiling)
        self.reply(client, s.Ok(req=msg.req))
        self.events.publish(s.RankCompiling(rank=msg.rank, pid=msg.pid, compiling=msg.compiling))

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
        if msg.hosts:  # this host's share of a communicator across hosts: the head's daemon publishes its joins
            self.across.join(msg)
            return self.reply(client, s.Ok(req=msg.req))
        self.collectives.ledger.join(msg)
        self.reply(client, s.Ok(req=msg.req))
        self.events.publish(
            s.CommJoined(
                comm=msg.comm, rank=msg.rank, size=msg.size, global_rank=msg.global_rank,
                transport=msg.transport, name=msg.name, desc=msg.desc,
            )
        )

    def _peer_directory(self, client: bytes, msg: s.PeerDirectory, fds: Sequence[int],
                        payload: Payload | None) -> None:
        """This host's agent says where the other hosts' daemons are: link to them."""
        if self.links is None:
            raise CommError("ncclInvalidUsage", "this daemon takes no peer links (it was started without --peer-listen)")
        if any(not isinstance(v, list) or len(v) != 2 for v in msg.peers.values()) or len(msg.key) != 64:
            raise CommError("ncclInvalidArgument", "a peer directory maps hosts to [endpoint, cipher], with a "
                                                   "32-byte run key in hex")
        try:
            self.links.link(msg.peers, bytes.fromhex(msg.key))
        except (PeerLinksError, ValueError, zmq.ZMQError) as e:  # (ZMQError: an endpoint that is not one)
            raise CommError("ncclInvalidUsage", f"cannot link to the other hosts' daemons: {e}") from None
        self.reply(client, s.Ok(req=msg.req))

    def _register_buffer(self, client: bytes, msg: s.RegisterBuffer, fds: Sequence[int],
                         payload: Payload | None) -> None:
        """A rank lends a tensor's storage (the descriptor in ``fds``) for zero-copy collectives."""
        self.collectives.buffers.register(client, msg.buf, msg.nbytes, list(fds))
        self.reply(client, s.Ok(req=msg.req))

    def _release_buffers(self, client: bytes, msg: s.ReleaseBuffers, fds: Sequence[int],
                         payload: Payload | None) -> None:
        """A rank's lent storages died: unmap them."""
        self.collectives.buffers.release(client, msg.bufs)
        self.reply(client, s.Ok(req=msg.req))

    def refuse(self, client: bytes, req: int, why: str) -> None:
        """Answer a request that is not one (malformed, unauthorized) with a ``protocol`` error, and say so."""
        self.reply(client, s.Error(req=req, code="protocol", message=why))
        self.events.publish(s.ProtocolError(message=why))
        # daemon.log too: the first refusals with their reason, then one line per thousand (a flood stays small)
        self.refused += 1
        if self.refused <= REFUSALS_LOGGED or self.refused % 1000 == 0:
            print(f"mirage daemon: refused request #{self.refused} from client {client.hex()}: {why[:200]}",
                  file=sys.stderr, flush=True)

    def publish_ready(self) -> None:
        """``daemon_ready``: this daemon's pid and what it emulates."""
        links = self.links
        self.events.publish(
            s.DaemonReady(pid=os.getpid(), profile=self.profile, nodes=self.nodes, gpus_per_node=self.gpus_per_node,
                          exec_mode=self.exec_mode, peer_endpoint=links.endpoint if links else "",
                          peer_cipher=links.cipher.name if links else "")
        )

    def rank_gone(self, rank: int, how: str) -> None:
        """``rank``'s process is gone: the books say how, and the session hears of it."""
        self.events.publish(s.RankGone(rank=rank, pid=self.ranks.gone(rank, how)))

    def check_peers(self) -> None:
        """Notice ranks whose process is gone, and fail the collectives waiting on them."""
        for rank, pid in self.ranks.exited():
            self.rank_gone(rank, f"rank {rank} (pid {pid}) exited")
        for rank in self.ranks.left_debugger():  # its peers' waits are hangs (or failures) again
            self.hangs.debugger(rank, stopped=False)
        self.collectives.fail_waits_on(self.ranks.dead)

    # ------------------------------------------------------------ the loop

    def serve(self) -> None:
        """The loop: take requests, run a wave, repeat; exits when ``running`` drops."""
        parent = os.getppid()
        next_scan = next_peer_check = 0.0
        self.publish_ready()
        while self.running:
            # queued events wake the loop up to go out even if nothing else happens
            across = self.across
            wait_s = 0.0 if self.collectives.busy or across.busy else self.events.wait_s(PEER_CHECK_INTERVAL_S)
            ready = dict(self.poller.poll(wait_s * 1000))
            links = self.links
            for sock, flags in ready.items():
                if sock is not self.router and (links is None or sock is not links.router):
                    if not self.fast.ready(sock, flags) and self.ranks.is_pidfd(sock):
                        self.check_peers()  # a rank died: at once, the first rank to go is the one to name
            if self.router in ready:
                self.read_router()
            if links is not None and links.router in ready:
                for msg, data in links.receive():
                    across.on_peer(msg, data)
            if across.busy:
                across.advance()
            if self.collectives.busy:
                self.collectives.run_wave()
            now = time.monotonic()
            if links is not None:
                links.beat(now)
            if now >= next_peer_check:  # often: the first rank to go is the one to name
                next_peer_check = now + PEER_CHECK_INTERVAL_S
                self.check_peers()
            if now >= next_scan:  # cheap, but not on every busy iteration
                next_scan = now + HANG_SCAN_INTERVAL_S
                self.scan_hangs(now)
                if links is not None:
                    across.check(now)
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
        for finding in self.hangs.scan(self.collectives.ledger, now, self.collectives.busy_ranks()):
            self.events.publish(finding)
        for finding in self.hangs.scan_worlds(self.worlds, self.ranks.alive, now):
            self.events.publish(finding)

    def stop_orphans(self) -> None:
        """The session is gone: stop the ranks it left (they would wait on nobody) and remove its arenas."""
        # another host's ranks are its agent's to stop (it stops them once the session stops answering)
        stop_orphans(self.session, self.ranks.local_pids())

    def close(self) -> None:
        """Send the last events, unmap the ranks' memory, close the sockets."""
        self.events.close()
        self.collectives.close()
        self.fast.close()
        self.ranks.close()
        if self.links is not None:
            self.links.close()
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
    s.PeerDirectory: Daemon._peer_directory,
    s.RegisterBuffer: Daemon._register_buffer,
    s.ReleaseBuffers: Daemon._release_buffers,
}


def run(run_dir: str, session: str, token: str, profile: str, nodes: int, gpus_per_node: int,
        hang_timeout_s: float, exec_mode: str = "functional", listen: str = "", secret_key_file: str = "",
        peer_listen: str = "") -> int:
    """Entry point used by ``python -m emulator``."""
    parent = os.getppid()
    die_with_parent()
    daemon = Daemon(run_dir, session, token, profile, nodes, gpus_per_node, hang_timeout_s, exec_mode, listen,
                    secret_key_file, peer_listen)

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
        # read by bench/allreduce_perf.py: what the collectives cost the daemon; by the multihost tests: which
        # data came through the socket transport (ranks' bytes), and which went to and from other hosts' daemons
        links = daemon.links
        print(f"mirage daemon exiting; cpu seconds: {usage.ru_utime + usage.ru_stime:.3f}; socket payload bytes "
              f"received: {daemon.collectives.payloads.received}; peer bytes sent: {links.sent_bytes if links else 0}, "
              f"received: {links.received_bytes if links else 0}", file=sys.stderr, flush=True)
    return 0
