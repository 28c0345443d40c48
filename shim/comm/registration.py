"""Which rank this process is, and telling the daemon so (the console names ranks by pid from this)."""

from __future__ import annotations

import os
import socket

#: The rank this process claimed: at start-up ($RANK, else 0; ``shim.bootstrap``), or when it
#: formed a world of its own (``shim.comm.world``); None for a descendant of a rank that has not.
RANK: int | None = None
#: The variable a rank's process sets to the rank it claimed: its descendants inherit it (shim.bootstrap
#: tells a launcher's child for another local rank from a DataLoader worker by it)
CLAIMED = "MIRAGE_CLAIMED_RANK"


def register_rank(rank: int) -> None:
    """Announce this process to the daemon as global rank ``rank`` and report its GPU memory under it."""
    if os.environ.get("MIRAGE_IN_PROCESS") == "1" or "MIRAGE_ENDPOINT" not in os.environ:
        return
    from shim.memory import allocator as memory
    from shim.rank.client import client, host_client
    from wire.schema import Hello

    node = int(os.environ.get("MIRAGE_NODE_RANK", "0"))
    hello = Hello(rank=rank, node=node, pid=os.getpid(), host=socket.gethostname())
    client().request(hello)
    if host_client() is not None:  # a multi-host run: this host's daemon watches the process too
        host_client().request(hello)
    memory.start_reporter(rank, node)
