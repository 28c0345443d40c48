"""Telling the daemon which rank this process is (the console names ranks by pid from this); the rank it
claimed is ``RUNTIME.claimed_rank``."""

from __future__ import annotations

import os
import socket

from shim.rank.runtime import RUNTIME

#: The variable a rank's process sets to the rank it claimed: its descendants inherit it (shim.bootstrap
#: tells a launcher's child for another local rank from a DataLoader worker by it)
CLAIMED = "MIRAGE_CLAIMED_RANK"


def register_rank(rank: int) -> None:
    """Announce this process to the daemon as global rank ``rank`` and report its GPU memory under it."""
    if not RUNTIME.settings.has_daemon:
        return
    from shim.memory import allocator as memory
    from wire.schema import Hello

    node = RUNTIME.settings.node_rank
    launched = RUNTIME.settings.launched_pid
    hello = Hello(rank=rank, node=node, pid=os.getpid(), host=socket.gethostname(),
                  launched_pid=0 if launched == os.getpid() else launched)
    RUNTIME.client().request(hello)
    if RUNTIME.host_client() is not None:  # a multi-host run: this host's daemon watches the process too
        RUNTIME.host_client().request(hello)
    memory.start_reporter(rank, node)
