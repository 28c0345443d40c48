"""Which network interface a multi-host run uses, chosen as NCCL chooses its socket interface.

``NCCL_SOCKET_IFNAME`` as NCCL reads it: a comma-separated list of name
prefixes (``eth,ib``), ``^`` in front to exclude them instead (``^docker,lo``),
``=`` in front for exact names (``=eth0``). Unset: the first interface that is
up, has an IPv4 address, and is neither loopback nor a ``docker`` bridge.
mirage binds only on the address of the interface chosen, never on all of them.
"""

from __future__ import annotations

import os
import socket

import psutil

from mirage_tui.config.topology import UsageError


def _matches(name: str, spec: str) -> bool:
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [i for i in spec.lstrip("=").split(",") if i]
    hit = any(name == i if exact else name.startswith(i) for i in items)
    return hit != exclude


def choose(spec: str | None = None) -> tuple[str, str]:
    """The (interface, IPv4 address) to bind on; ``spec`` defaults to ``$NCCL_SOCKET_IFNAME``.

    Raises :class:`UsageError` naming what was looked for when nothing matches.
    """
    spec = os.environ.get("NCCL_SOCKET_IFNAME") if spec is None else spec
    stats = psutil.net_if_stats()
    found = []
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if not v4 or not (stats.get(name) and stats[name].isup):
            continue
        if spec:
            if _matches(name, spec):
                found.append((name, v4[0]))
        elif not name.startswith(("lo", "docker")):
            found.append((name, v4[0]))
    if not found:
        have = ", ".join(sorted(stats)) or "none"
        want = f"NCCL_SOCKET_IFNAME={spec}" if spec else "an interface other than lo and docker*"
        raise UsageError(f"no network interface that is up with an IPv4 address matches {want} (interfaces: {have})")
    return sorted(found)[0]
