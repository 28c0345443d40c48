"""A host daemon's links to the other hosts' daemons (multi-host runs): sockets, keys, liveness.

Collectives across hosts go host daemon to host daemon (``wire.peers``,
:mod:`emulator.across_hosts`). Each host daemon binds one ROUTER on the run's
interface only, as a CURVE server with a key pair it makes at start (the secret
half never leaves the process; the public half goes out in its ``DaemonReady``
and reaches the other hosts through the head's CURVE bus, in the
``PeerDirectory`` its agent hands it). It sends over one DEALER per other host,
which knows that host's public key: nobody on the network can pose as a peer
daemon, read or change a chunk. A message counts only if it carries the session
token (checked as the daemon checks every request), so a stranger who completes
a CURVE handshake is ignored.

Every link carries a :class:`wire.peers.PeerBeat` each ``BEAT_S``, so a host
whose daemon went silent (the host died, its daemon was killed, the network
between them went down) can be told from one whose ranks are merely late.
"""

from __future__ import annotations

import hmac
import sys
import time

import zmq

from wire import peers as p
from wire import schema as s

#: How often every link carries a beat.
BEAT_S = 0.5
#: A host silent this long fails the collectives waiting on it. Twice the head's own silence rule for an
#: agent (``mirage_tui.hosts.protocol.SILENCE_S``), so that a host that died is first reported as lost, by name,
#: from the head.
SILENCE_S = 10.0
#: What CURVE adds to a message on the wire, rounded up (as ``emulator.daemon.CURVE_BOX_BYTES``).
CURVE_BOX_BYTES = 64
#: Messages read per turn of the daemon's loop, at most: its ranks' requests are not kept waiting.
READ_BUDGET = 64
#: Refused peer messages written to daemon.log one by one; after that, one line per thousand.
REFUSALS_LOGGED = 20


class PeerLinks:
    """This daemon's ROUTER for the other hosts' daemons, and a DEALER to each of them."""

    def __init__(self, ctx: zmq.Context, host: str, token: str, address: str):
        self.ctx = ctx
        self.host = host
        self.token = token
        self._token_bytes = token.encode()
        self.public_key, secret = zmq.curve_keypair()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, p.MAX_PEER_FRAME_BYTES + CURVE_BOX_BYTES)
        self.router.setsockopt(zmq.RCVHWM, 0)  # a peer's chunks are never dropped: each is part of a result
        self.router.curve_secretkey = secret
        self.router.curve_publickey = self.public_key
        self.router.curve_server = True
        self.router.bind(f"tcp://{address}:0")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.out: dict[str, zmq.Socket] = {}  # host -> the DEALER to its daemon
        self.heard: dict[str, float] = {}  # host -> when its daemon was last heard from (or linked)
        self.next_beat = 0.0
        self.sent_bytes = 0  # data frames' bytes, both ways: daemon.log's last line says them
        self.received_bytes = 0
        self.refused = 0

    def link(self, directory: dict[str, list[str]]) -> None:
        """Connect to every other host of ``directory`` (host -> [endpoint, public key]) not linked yet."""
        for host, (endpoint, key) in directory.items():
            if host == self.host or host in self.out:
                continue
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 0)  # sends never block the loop: what waits is a job's own buffers
            dealer.curve_serverkey = key.encode()
            dealer.curve_publickey, dealer.curve_secretkey = zmq.curve_keypair()
            dealer.connect(endpoint)
            self.out[host] = dealer
            self.heard[host] = time.monotonic()

    def knows(self, host: str) -> bool:
        return host == self.host or host in self.out

    def send(self, host: str, msg: p.PeerMessage, data=None) -> zmq.MessageTracker | None:
        """Send ``msg`` to ``host``'s daemon, ``data`` (a buffer) as its frame, not copied: the tracker says when
        ZeroMQ is done reading it (the caller must not change it before)."""
        head = s.encode(msg, token=self.token, host=self.host)
        dealer = self.out[host]
        if data is None:
            dealer.send(head, zmq.NOBLOCK)
            return None
        dealer.send(head, zmq.SNDMORE | zmq.NOBLOCK)
        self.sent_bytes += data.nbytes
        return dealer.send(data, zmq.NOBLOCK, copy=False, track=True)

    def beat(self, now: float) -> None:
        """A beat on every link, every ``BEAT_S``."""
        if now < self.next_beat:
            return
        self.next_beat = now + BEAT_S
        for host in self.out:
            try:
                self.send(host, p.PeerBeat())
            except zmq.Again:  # (no queue for that link: its silence speaks for it)
                pass

    def silent_for(self, host: str, now: float) -> float:
        """Seconds since ``host``'s daemon was last heard from."""
        return now - self.heard.get(host, now)

    def receive(self) -> list[tuple[p.PeerMessage, zmq.Frame | None]]:
        """The messages waiting (up to ``READ_BUDGET``), each with its data frame; anything malformed, or without
        the session token, is left out (and said in daemon.log)."""
        got = []
        for _ in range(READ_BUDGET):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) not in (2, 3):
                self.refuse(f"{len(frames)} frames")
                continue
            try:
                msg = p.decode(frames[1].bytes)
            except s.SchemaError as e:
                self.refuse(f"malformed: {e}")
                continue
            # surrogatepass: JSON may carry a lone surrogate, which strict utf-8 refuses
            if not hmac.compare_digest(msg.token.encode("utf-8", "surrogatepass"), self._token_bytes):
                self.refuse("wrong or missing session token")
                continue
            # (whether the sender is a host of the communicator a chunk names is for its exchange to check)
            self.heard[msg.host] = time.monotonic()
            data = frames[2] if len(frames) == 3 else None
            if data is not None:
                self.received_bytes += len(data)
            got.append((msg, data))
        return got

    def refuse(self, why: str) -> None:
        """daemon.log says why a peer message was dropped: the first ones, then one line per thousand."""
        self.refused += 1
        if self.refused <= REFUSALS_LOGGED or self.refused % 1000 == 0:
            print(f"mirage daemon: dropped peer message #{self.refused}: {why[:200]}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for dealer in self.out.values():
            dealer.close(0)
        self.router.close(0)
