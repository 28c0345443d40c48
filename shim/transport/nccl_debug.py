"""``NCCL_DEBUG=INFO``: the init lines RCCL prints when a communicator connects, in its format.

Users grep these (``via NET/Socket/0``, ``Init COMPLETE``) to check which
transport their ranks use; mirage prints them at the same moment RCCL does —
the first collective of a communicator — from what the daemon reports of the
communicator's ranks.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from shim.cuda.api import NCCL_VERSION
from shim.rank.runtime import RUNTIME
from wire.profiles import bus_id

def enabled() -> bool:
    return os.environ.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE")


def _interface() -> str:
    """``name:address`` of the interface the rank's host uses: loopback on one machine, the one a multi-host
    run's agent chose (``NCCL_SOCKET_IFNAME``) on several."""
    return RUNTIME.settings.socket_if


def net_only() -> bool:
    """P2P and SHM both disabled: RCCL connects even ranks of one host over the network."""
    return os.environ.get("NCCL_P2P_DISABLE") == "1" and os.environ.get("NCCL_SHM_DISABLE") == "1"


def transport(my_host: str, peer_host: str) -> str:
    """What RCCL would pick between two ranks, given the transports the environment disables.

    mirage's data path follows it (``shim.transport.transports.route``): a rank whose
    communicator has any NET/Socket connection sends its bytes as ZeroMQ frames.
    """
    if my_host != peer_host:
        return "NET/Socket/0"
    if os.environ.get("NCCL_P2P_DISABLE") != "1":
        return "P2P/IPC/read"
    if os.environ.get("NCCL_SHM_DISABLE") != "1":
        return "SHM/direct/direct"
    return "NET/Socket/0"


def print_init(comm: str, rank: int, devices: list[int], hosts: list[str]) -> None:
    """The lines of one rank's communicator init (ring channel to the next rank, then Init COMPLETE)."""
    dev = devices[rank]
    prefix = f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} [{dev}] NCCL INFO"
    version = ".".join(map(str, NCCL_VERSION))
    lines = []
    if RUNTIME.once.first("nccl-version"):  # the process's first communicator, as RCCL prints it
        lines.append(f"{prefix} RCCL version {version}+hip6.4 (emulated by mirage)")
        lines.append(f"{prefix} Bootstrap : Using {_interface()}<0>")
        for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_SOCKET_IFNAME"):
            if var in os.environ:
                lines.append(f"{prefix} {var} set by environment to {os.environ[var]}")
    size = len(devices)
    peer = (rank + 1) % size
    via = transport(hosts[rank], hosts[peer])
    if net_only() or len(set(hosts)) > 1:  # the communicator has network connections
        lines.append(f"{prefix} NET/Socket : Using [0]{_interface()}<0>")
    if size > 1:
        lines.append(f"{prefix} Channel 00/0 : {rank}[{dev}] -> {peer}[{devices[peer]}] via {via}")
    lines.append(f"{prefix} Connected all rings")
    lines.append(
        f"{prefix} ncclCommInitRankConfig comm 0x{comm[:12]} rank {rank} nranks {size} cudaDev {dev} "
        f"busId {bus_id(dev)} commId 0x{comm[-16:]} - Init COMPLETE"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
