"""Where a session's daemon listens: the socket files in its run directory, and its TCP endpoint file.

The daemon binds them, ranks and the console connect to them, and ``mirage cleanup``
removes what a killed session left; all read the names here.
"""

from __future__ import annotations

import os

#: The daemon's ZeroMQ request (ROUTER) and event (PUB) sockets, in the run directory.
RPC_SOCKET = "rpc.sock"
EVENT_SOCKET = "events.sock"
#: The daemon's second request socket (next to its ZeroMQ ``rpc.sock``): a unix SOCK_SEQPACKET
#: socket, one message per request or reply, for requests without data frames. ZeroMQ moves
#: each message through an I/O thread at either end (about 56 us a round trip here, against
#: 5 us for a bare unix socket), which dominated a small collective's latency.
FAST_SOCKET = "fast.sock"
#: Where a daemon started with ``--listen`` writes its TCP endpoint (read by the session).
TCP_ENDPOINT_FILE = "tcp-endpoint"


def endpoints(run_dir: str) -> tuple[str, str]:
    """The (rpc, events) ZeroMQ endpoints of the daemon serving ``run_dir``."""
    return f"ipc://{os.path.join(run_dir, RPC_SOCKET)}", f"ipc://{os.path.join(run_dir, EVENT_SOCKET)}"


def fast_socket_path(endpoint: str) -> str:
    """The fast socket's path next to the daemon's ``ipc://`` rpc ``endpoint``."""
    return os.path.join(os.path.dirname(endpoint[len("ipc://"):]), FAST_SOCKET)
