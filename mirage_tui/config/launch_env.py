"""The environment the session gives each process it launches: a node's command, or one rank of it.

Kept apart from the session, which owns processes, so that the one table of what
a rank is told (docs/architecture.md, *The session owns every process*) reads in
one place: what passes through from the user's shell, what a job scheduler or
torchrun would set, and the ``MIRAGE_*`` variables the shim reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mirage_tui.config.topology import ProgramClock, Topology, kept_env
from wire import faults
from wire.profiles import profile_path

BOOT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shim", "boot")


@dataclass(frozen=True)
class RankEnvironment:
    """What every launched process is told about the session it belongs to."""

    topology: Topology
    session: str
    run_dir: str
    token: str
    endpoint: str  # the daemon: ipc:// on this machine, tcp:// (CURVE) for ranks on other hosts
    master_addr: str = "127.0.0.1"  # this machine, or node 0's host
    server_key: str = ""  # the daemon's CURVE public key, for a tcp:// endpoint
    daemon_pid: int | None = None  # on this machine: ranks stop waiting once it is gone
    fork_server: str = ""  # the socket of this machine's fork server (forkserver.server); "" when none


def node_env(where: RankEnvironment, node: int, master_port: int) -> dict[str, str]:
    """The environment node process ``node`` starts with.

    One node is a machine's shell: no per-rank variables, so launchers that
    start their own ranks (Lightning, Accelerate, ``mp.spawn``) see what they
    would see there. Several nodes launched directly (one process per node)
    get ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` for ``env://``, as a job
    scheduler gives them. What the user exported passes through, as in a shell
    (with ``--clear-env-vars``, only :data:`~mirage_tui.config.topology.CLEARED_ENV_KEEPS`).
    """
    topo = where.topology
    if topo.clear_env:
        env = kept_env(dict(os.environ))
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("MIRAGE_RANK_PID", "MIRAGE_CLAIMED_RANK")}
    if topo.num_nodes > 1 and topo.nproc_per_node is None:
        env.update(RANK=str(node), WORLD_SIZE=str(topo.num_nodes), LOCAL_RANK="0")
    env.update(
        MASTER_ADDR=where.master_addr, MASTER_PORT=str(master_port),
        NCCL_HOSTID=f"mirage-node-{node}", PYTHONUNBUFFERED="1",
    )
    env.update(dict(topo.env))  # the user's --env wins over our defaults, not over MIRAGE_*
    env.update(
        MIRAGE_HEAD_ADDR=where.master_addr, MIRAGE_HEAD_PORT=str(master_port),
        MIRAGE_SESSION=where.session, MIRAGE_RUN_DIR=where.run_dir,
        MIRAGE_ENDPOINT=where.endpoint, MIRAGE_TOKEN=where.token,
        # the profile's file, not its name: a rank whose environment lost XDG_CONFIG_HOME
        # (the user's --env, a launcher's) still loads the same user profile
        MIRAGE_PROFILE=str(profile_path(topo.profile).absolute()), MIRAGE_GPUS_PER_NODE=str(topo.gpus_per_node),
        MIRAGE_NODE_RANK=str(node), MIRAGE_NUM_NODES=str(topo.num_nodes),
    )
    if topo.in_process:
        env["MIRAGE_IN_PROCESS"] = "1"
    if topo.exec_mode.keeps_time:
        env["MIRAGE_EXEC_MODE"] = topo.exec_mode.value
        if topo.program_clock is ProgramClock.EMULATED:  # the ranks' time.perf_counter & co. (shim.clock.program_clock)
            env["MIRAGE_PROGRAM_CLOCK"] = topo.program_clock.value
    if where.server_key:  # on another host: the daemon over TCP, CURVE (its public key), no pid to watch
        env["MIRAGE_SERVER_KEY"] = where.server_key
    if where.daemon_pid is not None:  # ranks stop waiting for replies once it is gone
        env["MIRAGE_DAEMON_PID"] = str(where.daemon_pid)
    if where.fork_server:  # Python processes hand themselves over to it (forkserver.handover)
        env["MIRAGE_FORK_SERVER"] = where.fork_server
    if topo.hbm_bytes is not None:
        env["MIRAGE_HBM_BYTES"] = str(topo.hbm_bytes)
    if topo.faults:
        env[faults.ENV] = ";".join(f.spec() for f in topo.faults)
    if topo.debug_rank is not None:  # that rank waits for a debugger before its program runs (shim.rank.debugger)
        env["MIRAGE_DEBUG_RANK"] = str(topo.debug_rank)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT_DIR, env.get("PYTHONPATH")) if p)
    return env


def rank_env(where: RankEnvironment, node: int, local_rank: int, master_port: int) -> dict[str, str]:
    """The environment of rank process ``local_rank`` of node ``node`` (``--nproc-per-node``).

    The node's environment plus what torchrun 2.13's agent gives each worker
    (``LocalElasticAgent._start_workers``), as a static rendezvous over all
    nodes would: one role, no restarts, no agent store (rank 0 hosts the
    ``env://`` store, there being no agent to host it). The per-rank
    variables win over ``--env``, as torchrun's do over the shell's.
    """
    topo = where.topology
    nproc = topo.nproc_per_node or 1
    rank, world = node * nproc + local_rank, topo.num_nodes * nproc
    env = node_env(where, node, master_port)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(topo.num_nodes),
        ROLE_RANK=str(rank), ROLE_NAME="default", ROLE_WORLD_SIZE=str(world),
        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=f"mirage-{where.session}", TORCHELASTIC_USE_AGENT_STORE="False",
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers per node
    return env

