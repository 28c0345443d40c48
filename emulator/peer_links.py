"""A host daemon's links to the other hosts' daemons (multi-host runs): sockets, seals, liveness.

Collectives across hosts go host daemon to host daemon (``wire.peers``,
:mod:`emulator.across_hosts`). Each host daemon binds one ROUTER on the run's
interface only and sends over one DEALER per other host; every message on
them is sealed with the run's peer keys (:mod:`emulator.peer_seal`: an
authenticated cipher, a key per direction of each link, derived from a run key
that reached this daemon through the head's CURVE bus and its agent, in the
``PeerDirectory``), so nobody without that key can read a chunk, change it,
replay it or pose as a peer daemon. A message that does not open is dropped
and said in daemon.log. Inside the seal, every message also carries the
session token, checked as the daemon checks every request.

Every link carries a :class:`wire.peers.PeerBeat` each ``BEAT_S``, so a host
whose daemon went silent (the host died, its daemon was killed, the network
between them went down) can be told from one whose ranks are merely late.
"""

from __future__ import annotations

import hmac
import sys
import time

import zmq

from emulator.peer_seal import TAG_BYTES, Sealed, Seals, SealError, best_cipher, keep_freed_buffers
from wire import peers as p
from wire import schema as s

#: How often every link carries a beat.
BEAT_S = 0.5
#: A host silent this long fails the collectives waiting on it. Twice the head's own silence rule for an
#: agent (``mirage_tui.hosts.protocol.SILENCE_S``), so that a host that died is first reported as lost, by name,
#: from the head.
SILENCE_S = 10.0
#: Messages read per turn of the daemon's loop, at most: its ranks' requests are not kept waiting.
READ_BUDGET = 64
#: Refused peer messages written to daemon.log one by one; after that, one line per thousand.
REFUSALS_LOGGED = 20


class PeerLinksError(Exception):
    """This daemon cannot take peer links (no cipher: libsodium missing)."""


class PeerLinks:
    """This daemon's ROUTER for the other hosts' daemons, and a DEALER to each of them."""

    def __init__(self, ctx: zmq.Context, host: str, token: str, address: str):
        cipher = best_cipher()
        if cipher is None:
            raise PeerLinksError("libsodium, which seals the links between host daemons, was not found")
        self.cipher = cipher
        keep_freed_buffers()
        self.ctx = ctx
        self.host = host
        self.token = token
        self._token_bytes = token.encode()
        self.seals: Seals | None = None  # once the run key came with the directory
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, p.MAX_PEER_FRAME_BYTES + TAG_BYTES)
        self.router.setsockopt(zmq.RCVHWM, 0)  # a peer's chunks are never dropped: each is part of a result
        self.router.bind(f"tcp://{address}:0")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.out: dict[str, zmq.Socket] = {}  # host -> the DEALER to its daemon
        self.heard: dict[str, float] = {}  # host -> when its daemon was last heard from (or linked)
        self.next_beat = 0.0
        self.sent_bytes = 0  # data parts' bytes, both ways: daemon.log's last line says them
        self.received_bytes = 0
        self.refused = 0

    def link(self, directory: dict[str, list[str]], run_key: bytes) -> None:
        """Connect to every other host of ``directory`` (host -> [endpoint, cipher]) not linked yet, sealing
        with keys derived from ``run_key``; every host must seal with this daemon's cipher."""
        other = {h: c for h, (_, c) in directory.items() if c != self.cipher.name}
        if other:
            raise PeerLinksError(f"hosts {sorted(other)} seal with {sorted(set(other.values()))}, this one with "
                                 f"{self.cipher.name}")
        if self.seals is None:
            self.seals = Seals(self.cipher, self.host, run_key)
        elif self.seals.run_key != run_key:
            raise PeerLinksError("a second directory with another run key")
        for host, (endpoint, _) in directory.items():
            if host == self.host or host in self.out:
                continue
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 0)  # sends never block the loop: each is a part of a result
            dealer.connect(endpoint)
            self.out[host] = dealer
            self.heard[host] = time.monotonic()

    def knows(self, host: str) -> bool:
        return host == self.host or host in self.out

    def send(self, host: str, msg: p.PeerMessage, data=None) -> None:
        """Send ``msg`` to ``host``'s daemon, ``data`` (a buffer) after it; both sealed (read now: the caller may
        change ``data`` once this returns)."""
        frames = self.seals.seal(host, s.encode(msg, token=self.token, host=self.host), data)
        if data is not None:
            self.sent_bytes += len(frames[2]) - self.cipher.tag_bytes
        self.out[host].send_multipart(frames, zmq.NOBLOCK, copy=False)

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

    def receive(self) -> list[tuple[p.PeerMessage, Sealed | None]]:
        """The messages waiting (up to ``READ_BUDGET``), each with its data, still sealed (opened where it goes);
        one that does not open, is malformed or lacks the session token is left out (and said in daemon.log)."""
        got = []
        for _ in range(READ_BUDGET):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if self.seals is None:
                self.refuse("a message before this daemon had the run's peer key")
                continue
            try:
                src, header, data = self.seals.open([f.buffer for f in frames[1:]])
                msg = p.decode(header.tobytes())
            except (SealError, s.SchemaError) as e:
                self.refuse(str(e))
                continue
            # surrogatepass: JSON may carry a lone surrogate, which strict utf-8 refuses
            if msg.host != src or not hmac.compare_digest(msg.token.encode("utf-8", "surrogatepass"),
                                                          self._token_bytes):
                self.refuse("wrong sender or session token")
                continue
            # (whether the sender is a host of the communicator a chunk names is for its exchange to check)
            self.heard[src] = time.monotonic()
            if data is not None:
                self.received_bytes += data.nbytes
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
