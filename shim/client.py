"""The rank's connection to the daemon: requests over ZeroMQ, data through its arena."""

from __future__ import annotations

import itertools
import os
import threading
import time

import torch
import zmq

from emulator import schema as s
from emulator.arena import Arena, arena_name

_ALIGN = 64


class DaemonClient:
    """One DEALER socket per process; requests are serialised by a lock."""

    def __init__(self, endpoint: str, token: str, session: str, tag: str):
        self.token = token
        self.session = session
        self.tag = tag
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._arena: Arena | None = None
        self._generation = 0

    def request(self, msg: s.Request, timeout_s: float = 60.0) -> s.Reply:
        """Send ``msg`` (token and id filled in) and wait for its reply."""
        req = next(self._ids)
        msg = type(msg)(**{**msg.__dict__, "token": self.token, "req": req})
        with self._lock:
            self._sock.send(s.encode(msg))
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply from the mirage daemon within {timeout_s:.0f} s")
                if not self._sock.poll(min(left, 1.0) * 1000):
                    continue
                reply = s.decode(self._sock.recv())
                if isinstance(reply, s.Reply) and reply.req == req:
                    return reply

    def arena(self, nbytes: int) -> Arena:
        """This rank's shared-memory arena, grown (by doubling) to hold ``nbytes``."""
        if self._arena is None or self._arena.size < nbytes:
            size = max(nbytes, 2 * (self._arena.size if self._arena else 1 << 20))
            if self._arena is not None:
                self._arena.close()
                self._arena.unlink()  # the daemon keeps its own mapping until it lets go
            self._generation += 1
            self._arena = Arena.create(arena_name(self.session, f"{self.tag}-g{self._generation}"), size)
        return self._arena

    def close(self) -> None:
        if self._arena is not None:
            self._arena.unlink()
        self._sock.close(0)


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def arena_tensor(arena: Arena, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor sharing the arena's memory at ``offset``."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(arena.buf, dtype=dtype, count=numel, offset=offset)


_client: DaemonClient | None = None


def client() -> DaemonClient:
    """The process's daemon client, connected on first use."""
    global _client
    if _client is None:
        rank = os.environ.get("RANK", "0")
        _client = DaemonClient(
            os.environ["MIRAGE_ENDPOINT"],
            os.environ["MIRAGE_TOKEN"],
            os.environ["MIRAGE_SESSION"],
            f"r{rank}-p{os.getpid()}",
        )
    return _client
