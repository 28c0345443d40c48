"""A hand-made run of many ranks for the fold, snapshot and performance tests: 2D-parallel steps, known laggards.

``nodes`` nodes of eight GPUs, eight nodes to a host. Every node's ranks form a
``mesh_tp`` communicator, every local index across the nodes a ``mesh_dp`` one;
``default_pg`` holds them all. A step is two tensor-parallel all-reduces, one
data-parallel all-reduce, a line of output and a memory report per rank. After
the full steps the run stops part-way through one more (:func:`events`), at a
moment with one answer to "who is behind": ``SLOW_TP`` never posts its node's
first tensor-parallel all-reduce (its seven peers wait in it, and the rest of
the world in the data-parallel one, for the eight of that node), and
``SLOW_DP`` finishes the tensor-parallel part but never posts the
data-parallel all-reduce. ``BIG_MEMORY`` holds twice the others' memory and
``SMALL_MEMORY`` a tenth. Every figure is known here; no process runs.
"""

from __future__ import annotations

import dataclasses
import hashlib

from wire import schema as s

GPUS_PER_NODE = 8
NODES_PER_HOST = 8
NUMEL = 1 << 20
GIB = 1 << 30
HBM = 64 * GIB


def slow_tp(ranks: int) -> int:
    """The rank its node's tensor-parallel group waits for: in the second node, its third GPU."""
    return GPUS_PER_NODE + 2


def slow_dp(ranks: int) -> int:
    """The rank its data-parallel group waits for (alone: its node's tensor-parallel part finished)."""
    return ranks - 5


def big_memory(ranks: int) -> int:
    """The rank that holds twice the others' memory."""
    return ranks // 2 + 1


def small_memory(ranks: int) -> int:
    """The rank that holds a tenth of the others' memory."""
    return ranks // 4 + 3


def _comm_id(kind: str, index: int) -> str:
    """An id shaped like the daemon's (32 hex digits), fixed for the snapshots."""
    return hashlib.md5(f"{kind}{index}".encode()).hexdigest()


def events(ranks: int, steps: int = 3, step_s: float = 0.2, t0: float = 1000.0, partial: bool = True,
           lines_per_step: int = 1) -> list[s.Event]:
    """The run's events in order: ``steps`` full steps of ``step_s`` seconds, then (``partial``) the stop.

    Events are spread evenly over each step, so a replay at speed 1 produces the rate a run of
    ``ranks`` ranks doing ``1 / step_s`` steps a second would.
    """
    assert ranks % GPUS_PER_NODE == 0
    nodes = ranks // GPUS_PER_NODE
    head: list[s.Event] = [s.DaemonReady(t=t0, pid=1, profile="mi300x", nodes=nodes, gpus_per_node=GPUS_PER_NODE)]
    for r in range(ranks):
        node = r // GPUS_PER_NODE
        head.append(s.RankRegistered(t=t0, rank=r, node=node, pid=10_000 + r,
                                     host=f"host{node // NODES_PER_HOST}"))
    world = _comm_id("w", 0)
    tp = {n: _comm_id("t", n) for n in range(nodes)}
    dp = {g: _comm_id("d", g) for g in range(GPUS_PER_NODE)}
    for r in range(ranks):
        node, local = divmod(r, GPUS_PER_NODE)
        head.append(s.CommJoined(t=t0, comm=world, rank=r, size=ranks, global_rank=r, name="0", desc="default_pg"))
        head.append(s.CommJoined(t=t0, comm=tp[node], rank=local, size=GPUS_PER_NODE, global_rank=r,
                                 name=str(1 + node), desc="mesh_tp"))
        head.append(s.CommJoined(t=t0, comm=dp[local], rank=node, size=nodes, global_rank=r,
                                 name=str(1 + nodes + local), desc="mesh_dp"))

    def memory(r: int, step: int) -> int:
        base = 12 * GIB + (r % 7) * 64 * (1 << 20) + step * (1 << 20)
        if r == big_memory(ranks):
            return 2 * base
        if r == small_memory(ranks):
            return base // 10
        return base

    body: list[list[s.Event]] = []  # one list per step, timed afterwards

    def step_events(step: int, stop: bool) -> list[s.Event]:
        out: list[s.Event] = []
        held_tp = {slow_tp(ranks)} if stop else set()
        held_dp = {slow_dp(ranks)} if stop else set()
        blocked_nodes = {r // GPUS_PER_NODE for r in held_tp}
        for k in (1, 2):  # tensor-parallel: each node's group
            seq = 2 * (step - 1) + k
            for node in range(nodes):
                if node in blocked_nodes and k == 2:
                    continue  # its first all-reduce never started
                members = [node * GPUS_PER_NODE + g for g in range(GPUS_PER_NODE)]
                posted = [r for r in members if r not in held_tp]
                for r in posted:
                    out.append(s.CollectiveEnqueued(t=0, comm=tp[node], seq=seq, rank=r % GPUS_PER_NODE,
                                                    op=s.CollOp.ALLREDUCE, numel=NUMEL, device=r % GPUS_PER_NODE,
                                                    site="model.py:88"))
                if len(posted) == len(members):
                    out.append(s.CollectiveStarted(t=0, comm=tp[node], seq=seq, total_bytes=4 * NUMEL))
                    out.append(s.CollectiveCompleted(t=0, comm=tp[node], seq=seq, total_bytes=4 * NUMEL,
                                                     seconds=0.002))
        for g in range(GPUS_PER_NODE):  # data-parallel: each local index's group across the nodes
            members = [n * GPUS_PER_NODE + g for n in range(nodes)]
            posted = [r for r in members if r not in held_dp and r // GPUS_PER_NODE not in blocked_nodes]
            for r in posted:
                out.append(s.CollectiveEnqueued(t=0, comm=dp[g], seq=step, rank=r // GPUS_PER_NODE,
                                                op=s.CollOp.ALLREDUCE, numel=4 * NUMEL, device=g,
                                                site="train.py:41"))
            if len(posted) == len(members):
                out.append(s.CollectiveStarted(t=0, comm=dp[g], seq=step, total_bytes=16 * NUMEL))
                out.append(s.CollectiveCompleted(t=0, comm=dp[g], seq=step, total_bytes=16 * NUMEL, seconds=0.004))
        if not stop:
            for r in range(ranks):
                for i in range(lines_per_step):
                    out.append(s.OutputLine(t=0, rank=r, node=r // GPUS_PER_NODE, stream=s.Stream.STDOUT,
                                            text=f"[rank {r}] step {step}.{i} loss {2.5 / step:.4f}"))
                out.append(s.MemoryUsage(t=0, rank=r, node=r // GPUS_PER_NODE, device=r % GPUS_PER_NODE,
                                         allocated=memory(r, step), reserved=memory(r, step) + GIB,
                                         peak=memory(r, step) + GIB // 2, total=HBM))
        return out

    for step in range(1, steps + 1):
        body.append(step_events(step, False))
    if partial:
        body.append(step_events(steps + 1, True))
    out = head
    for i, chunk in enumerate(body):
        begin = t0 + 0.01 + i * step_s
        for j, e in enumerate(chunk):
            out.append(_at(e, begin + step_s * j / max(1, len(chunk))))
    return out


def _at(event: s.Event, t: float) -> s.Event:
    """``event`` at time ``t`` (events are frozen)."""
    return dataclasses.replace(event, t=t)
