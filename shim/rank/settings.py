"""Every ``MIRAGE_*`` variable the shim reads, read once from the environment.

The session sets them when it starts a node's processes
(``mirage_tui/config/launch_env.py``) and nothing changes them afterwards, so a
process reads them once, into one frozen :class:`Settings` that the rank's
runtime holds (``shim.rank.runtime.RUNTIME.settings``). Two of them are also
written, for a process's *descendants* only: ``MIRAGE_RANK_PID`` and
``MIRAGE_CLAIMED_RANK`` (``shim.bootstrap``, ``shim.comm.world``); the fields
here are what this process inherited.

Only the standard library: every Python process of a session imports this
from ``sitecustomize`` (``shim.bootstrap``), torch or not.

Not here: the variables of torch, NCCL and launchers (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``NCCL_DEBUG``, ...), which user
code may set after the shim loaded and which the shim reads where torch would;
and ``MIRAGE_SESSION`` in ``shim/boot/sitecustomize.py``, which decides whether
the shim is imported at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    # unset and empty both mean the default, as the shim's reads always took them
    return int(env.get(name) or default)


@dataclass(frozen=True)
class Settings:
    """A rank's ``MIRAGE_*`` settings; each field names its variable and says what it means."""

    #: MIRAGE_SESSION: the session's id, which names its shared-memory files
    session: str = ""
    #: MIRAGE_RUN_DIR: the run directory (rank output, traces, daemon.log)
    run_dir: str = ""
    #: MIRAGE_ENDPOINT: the (head) daemon's ZeroMQ endpoint, ``ipc://`` on one host, ``tcp://`` across hosts
    endpoint: str = ""
    #: MIRAGE_TOKEN: the session's secret, sent with every request
    token: str = ""
    #: MIRAGE_DAEMON_PID: the daemon's pid, watched while waiting for a reply (0: unknown)
    daemon_pid: int = 0
    #: MIRAGE_SERVER_KEY: the daemon's CURVE public key (Z85), for a ``tcp://`` endpoint
    server_key: str = ""
    #: MIRAGE_HOST_ENDPOINT: in a multi-host run, this host's daemon (its agent sets it); "" on one machine
    host_endpoint: str = ""
    #: MIRAGE_HOST_DAEMON_PID: that daemon's pid (0: unknown)
    host_daemon_pid: int = 0
    #: MIRAGE_IN_PROCESS=1: ``mirage run --in-process``, no daemon: collectives go to an in-process backend
    in_process: bool = False
    #: MIRAGE_EXEC=1: a command ``mirage exec`` runs beside the job: a probe, not a rank
    exec_probe: bool = False
    #: MIRAGE_EXEC_MODE=clocked or estimate: keep emulated time (``shim.clock``); anything else is functional mode
    clocked: bool = False
    #: MIRAGE_EXEC_MODE=estimate: emulated tensors hold no values (meta tensors inside), collectives move no bytes
    estimate: bool = False
    #: MIRAGE_PROGRAM_CLOCK=emulated: in a clocked run, the program's ``time.perf_counter``/``monotonic``/``time``
    #: read the rank's emulated time (``shim.clock.program_clock``); ``wall`` (the default) leaves them alone
    program_clock: str = "wall"
    #: MIRAGE_NODE_RANK: this emulated node's index
    node_rank: int = 0
    #: MIRAGE_NUM_NODES: how many emulated nodes the run has
    num_nodes: int = 1
    #: MIRAGE_GPUS_PER_NODE: the emulated GPUs of a node (before ``*_VISIBLE_DEVICES``)
    gpus_per_node: int = 1
    #: MIRAGE_PROFILE: the GPU profile, a name or a TOML file (``wire.profiles.load_profile``)
    profile: str = "mi350x"
    #: MIRAGE_HBM_BYTES: each GPU's memory (``--hbm``); None: the profile's
    hbm_bytes: int | None = None
    #: MIRAGE_RANK_PID: the pid of the rank this process descends from (inherited); None in a node's first process
    rank_pid: str | None = None
    #: MIRAGE_CLAIMED_RANK: the rank the process this one descends from claimed (inherited)
    claimed_rank: str | None = None
    #: MIRAGE_DEBUG_RANK: the rank ``--debug-rank`` stops for a debugger before its program runs
    debug_rank: str | None = None
    #: MIRAGE_FORKED_AS: "<pid>:<stub pid>" in a rank the session's fork server forked (forkserver.program):
    #: the stub is the process its launcher started and watches
    forked_as: str = ""
    #: MIRAGE_DEBUGGER: which debugger that rank waits for, ``pdb`` or ``debugpy``
    debugger: str = "pdb"

    @property
    def launched_pid(self) -> int:
        """The pid this process's launcher started and watches: its fork server stub's if the server forked
        this very process (not a child it forked in turn), else its own."""
        pid, _, stub = self.forked_as.partition(":")
        return int(stub) if pid == str(os.getpid()) and stub.isdigit() else os.getpid()
    #: MIRAGE_ZERO_COPY: when a tensor's storage becomes the daemon's buffer: reuse (from its 2nd collective),
    #: always, off (``shim.transport.shared_buffers``)
    zero_copy: str = "reuse"
    #: MIRAGE_ZERO_COPY_MIN_BYTES: the smallest tensor taken zero-copy
    zero_copy_min_bytes: int = 256 << 10
    #: MIRAGE_ACROSS_HOSTS_MIN_BYTES: collectives across hosts from this size go host daemon to host daemon;
    #: smaller ones take the head's one round trip, which costs less (``shim.transport.across_hosts``)
    across_hosts_min_bytes: int = 256 << 10
    #: MIRAGE_DIRECT_MAX_BYTES: the largest collective taken rank to rank, as given (0: off); checked where
    #: that path loads (``shim.transport.direct``), so a bad value stops the ranks, not every process
    direct_max_bytes: str = str(64 << 10)
    #: MIRAGE_SOCKET_IF: the interface NCCL_DEBUG's NET/Socket lines name, ``<if>:<address>``
    socket_if: str = "lo:127.0.0.1"
    #: MIRAGE_INJECT: the faults to inject (``wire.faults``)
    inject: str = ""
    #: MIRAGE_COMPILE: torch.compile's setting: "" compiles, ``eager`` runs eagerly (``shim.compile``)
    compile: str = ""
    #: MIRAGE_CACHE_DIR: where the C++ libraries are built ("": the user's cache, ``shim.native.build``)
    cache_dir: str = ""

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """The settings ``env`` (the process's environment) gives; unset variables take their defaults."""
        hbm = env.get("MIRAGE_HBM_BYTES")
        return cls(
            session=env.get("MIRAGE_SESSION", ""),
            run_dir=env.get("MIRAGE_RUN_DIR", ""),
            endpoint=env.get("MIRAGE_ENDPOINT", ""),
            token=env.get("MIRAGE_TOKEN", ""),
            daemon_pid=_int(env, "MIRAGE_DAEMON_PID", 0),
            server_key=env.get("MIRAGE_SERVER_KEY", ""),
            host_endpoint=env.get("MIRAGE_HOST_ENDPOINT", ""),
            host_daemon_pid=_int(env, "MIRAGE_HOST_DAEMON_PID", 0),
            in_process=env.get("MIRAGE_IN_PROCESS") == "1",
            exec_probe=env.get("MIRAGE_EXEC") == "1",
            clocked=env.get("MIRAGE_EXEC_MODE") in ("clocked", "estimate"),
            estimate=env.get("MIRAGE_EXEC_MODE") == "estimate",
            program_clock=env.get("MIRAGE_PROGRAM_CLOCK") or "wall",
            node_rank=_int(env, "MIRAGE_NODE_RANK", 0),
            num_nodes=_int(env, "MIRAGE_NUM_NODES", 1),
            gpus_per_node=_int(env, "MIRAGE_GPUS_PER_NODE", 1),
            profile=env.get("MIRAGE_PROFILE", "mi350x"),
            hbm_bytes=int(hbm) if hbm else None,
            rank_pid=env.get("MIRAGE_RANK_PID"),
            claimed_rank=env.get("MIRAGE_CLAIMED_RANK"),
            debug_rank=env.get("MIRAGE_DEBUG_RANK"),
            forked_as=env.get("MIRAGE_FORKED_AS", ""),
            debugger=env.get("MIRAGE_DEBUGGER", "pdb"),
            zero_copy=env.get("MIRAGE_ZERO_COPY", "reuse").lower(),
            zero_copy_min_bytes=_int(env, "MIRAGE_ZERO_COPY_MIN_BYTES", 256 << 10),
            across_hosts_min_bytes=_int(env, "MIRAGE_ACROSS_HOSTS_MIN_BYTES", 256 << 10),
            direct_max_bytes=env.get("MIRAGE_DIRECT_MAX_BYTES", str(64 << 10)),
            socket_if=env.get("MIRAGE_SOCKET_IF", "lo:127.0.0.1"),
            inject=env.get("MIRAGE_INJECT", ""),
            compile=env.get("MIRAGE_COMPILE", ""),
            cache_dir=env.get("MIRAGE_CACHE_DIR", ""),
        )

    @property
    def has_daemon(self) -> bool:
        """Whether this process talks to a daemon: a session's rank does, unless run ``--in-process``; a
        process outside a session (a test importing the shim) has no endpoint."""
        return not self.in_process and bool(self.endpoint)
