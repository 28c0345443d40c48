"""Which transport carries a communicator's collective (``shim/transport/transports.py``, ``shapes.py``)."""

from __future__ import annotations

import torch

from shim.rank.runtime import RUNTIME
from shim.transport.across_hosts import AcrossHostsTransport
from shim.transport.shapes import ShapesTransport
from shim.transport.transports import (
    ArenaTransport,
    Call,
    Comm,
    DirectTransport,
    InProcessTransport,
    SocketTransport,
    Transport,
)


class Paths:
    """A communicator's transports, and the one decision of which carries a collective."""

    def __init__(self, comm: Comm, data_path: str | None, across: AcrossHostsTransport | None = None):
        """``data_path``: ``"shm"`` or ``"socket"`` (:func:`data_path`), None in process; ``across``: a
        communicator across hosts whose collectives may go host daemon to host daemon."""
        self.comm = comm
        self.across = across
        if data_path is None:
            self.main: Transport = InProcessTransport(comm)
        elif data_path == "socket":
            self.main = SocketTransport(comm)
        else:
            self.main = ArenaTransport(comm)
        ok = data_path == "shm" and comm.client.has_fast and RUNTIME.staging.direct_max_bytes > 0
        self.direct = DirectTransport(comm) if ok else None
        self.shapes = ShapesTransport(comm) if data_path is not None and RUNTIME.settings.estimate else None

    def path(self, call: Call) -> Transport:
        """Which transport carries ``call``: rank to rank if it is small enough and may, host daemon to host
        daemon if it is an all-reduce, reduce-scatter, all-gather or broadcast across hosts, else the
        communicator's own (shared memory, with zero-copy decided there, or the socket)."""
        if self.shapes is not None and any(t.is_meta for t in call.inputs):
            return self.shapes  # estimate mode: tensors without values
        if self.direct is not None and self.direct.takes(call):
            return self.direct
        if self.across is not None and self.across.takes(call):
            return self.across
        return self.main

    def p2p(self, elem: torch.Tensor) -> Transport:
        """Which transport carries a send or a receive of ``elem``."""
        return self.shapes if self.shapes is not None and elem.is_meta else self.main
