"""World formation: a rank tells the daemon it waits in ``init_process_group``, and when its world formed.

``init_process_group`` blocks until every rank of the world arrives (the
TCPStore server waits for its ``world_size - 1`` clients, a client for the
server; the group's creation reads every rank's keys). A rank that never comes
(a wrong ``WORLD_SIZE``, a rank that exited first, a launcher that never
started it) leaves the others waiting there, before any collective exists:
the daemon's hang detector watches these waits as it watches collectives.

This is also where a process learns its rank when a launcher other than
torchrun started it (Lightning's subprocesses, ``mp.spawn`` children: they
inherit no ``RANK``, or their parent's): the first time it forms a world it
claims that rank's output files, stack dumps and registration.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import socket
import sys
from urllib.parse import parse_qs, urlparse

import torch.distributed.distributed_c10d as c10d

from shim.comm import state as _state  # noqa: F401 - it builds RUNTIME.comm
from shim.rank.runtime import RUNTIME
from shim.rank.call_site import call_site
from wire import schema as s

#: What a command started by ``mirage exec`` gets when it calls ``init_process_group``.
EXEC_REFUSAL = ("mirage: a command run by 'mirage exec' may not join the job's process groups (it would be an "
                "extra rank its collectives never wait for); probe the emulated GPUs, or add it to the job itself")


def install() -> None:
    """Wrap ``init_process_group`` wherever torch's modules hold it."""
    original = c10d.init_process_group
    if getattr(original, "_mirage_world", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if RUNTIME.settings.exec_probe:
            raise RuntimeError(EXEC_REFUSAL)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch's own error for the call
        bound.apply_defaults()
        a = bound.arguments
        found = _world_of(a["init_method"], a["store"], a["rank"], a["world_size"])
        if found is None or not RUNTIME.settings.has_daemon:
            return original(*args, **kwargs)
        address, rank, size = found
        world = f"{address} #{next(RUNTIME.comm.formed.setdefault(address, itertools.count(1)))}"
        _claim(rank)
        client = RUNTIME.client
        note = functools.partial(s.WorldFormation, world=world, rank=rank, size=size, pid=os.getpid(),
                                 host=socket.gethostname(),
                                 site=call_site())
        client().request(note(phase=s.WorldPhase.JOINING))
        try:
            result = original(*args, **kwargs)
        except BaseException:
            client().request(note(phase=s.WorldPhase.FAILED))
            raise
        client().request(note(phase=s.WorldPhase.FORMED))
        return result

    init_process_group._mirage_world = True
    # every module that imported the name already (torch.distributed, its device_mesh: init_device_mesh)
    for module in list(sys.modules.values()):
        held = getattr(module, "__dict__", {}).get("init_process_group")
        if held is original and getattr(module, "__name__", "").startswith("torch"):
            module.init_process_group = init_process_group


def _world_of(init_method, store, rank: int, world_size: int) -> tuple[str, int, int] | None:
    """(rendezvous address, rank, world size) as ``init_process_group`` will resolve them; None if unknown."""
    if store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        address = f"tcp://{host}:{port}" if host and port else "store"
        return (address, rank, world_size) if rank >= 0 and world_size > 0 else None
    url = urlparse(init_method or "env://")
    query = parse_qs(url.query)
    try:
        if rank < 0 and "rank" in query:
            rank = int(query["rank"][0])
        if world_size < 0 and "world_size" in query:
            world_size = int(query["world_size"][0])
        if url.scheme == "env":
            rank = rank if rank >= 0 else int(os.environ.get("RANK", "-1"))
            world_size = world_size if world_size >= 0 else int(os.environ.get("WORLD_SIZE", "-1"))
    except ValueError:
        return None  # torch says what is wrong with them
    if url.scheme == "env":
        address = f"env://{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    else:
        address = f"{url.scheme}://{url.netloc}{url.path}"
    return (address, rank, world_size) if 0 <= rank < world_size else None


def _claim(rank: int) -> None:
    """Make this process rank ``rank``: its output, stack dumps and registration (if it is not already)."""
    from shim.clock import program_clock
    from shim.comm import registration
    from shim.rank.output import arm_stack_dumps, capture

    if RUNTIME.has_claimed(rank):
        return
    RUNTIME.claim(rank)
    os.environ["MIRAGE_RANK_PID"] = str(os.getpid())  # its own children (DataLoader workers) are its descendants
    os.environ[registration.CLAIMED] = str(rank)
    run_dir = RUNTIME.settings.run_dir
    capture(run_dir, rank)
    arm_stack_dumps(run_dir, rank)
    registration.register_rank(rank)
    program_clock.install()  # --program-clock emulated: a rank reads its emulated time (a fork's child did not)
