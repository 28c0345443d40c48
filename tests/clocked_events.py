"""A hand-made clocked run for the fold, report, batch and console tests: DDP-like steps, one slow rank.

Four ranks on one node share one communicator. Each step is a forward and a backward pass, two
gradient all-reduces (the first posted halfway through the backward pass, the second at its end)
and the optimizer's update. The daemon starts a collective when its last member is ready (as
``emulator/collective_clock.py`` does), so the slow rank's late arrival delays every rank. Step 1
carries 20 ms of warm-up. Times are emulated seconds; every figure is exact and known here.
"""

from __future__ import annotations

import os

from wire import schema as s

COMM = "c10c4ed5a1b2c3d4e5f60718293a4b5c"
RANKS = 4
SLOW_RANK = 2
SLOW = 1.4  # the slow rank's compute, relative to the others'
FWD, BWD, OPT = 3e-3, 5e-3, 1e-3
BUCKET1, BUCKET2 = 1.5e-3, 2e-3  # the all-reduces' emulated durations
WARMUP = 20e-3
ALGO = "ring/Simple"
NUMEL = 1 << 20


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def events(steps: int = 6, exec_mode: str = "clocked") -> list[s.Event]:
    """The run's events, in order, ending with every node process exiting 0 and the session's end."""
    out: list[s.Event] = []
    wall = 1000.0

    def at() -> float:
        nonlocal wall
        wall += 0.01
        return wall

    out.append(s.DaemonReady(t=at(), pid=1, profile="mi350x", nodes=1, gpus_per_node=RANKS, exec_mode=exec_mode))
    for r in range(RANKS):
        out.append(s.RankRegistered(t=at(), rank=r, node=0, pid=100 + r))
    for r in range(RANKS):
        out.append(s.CommJoined(t=at(), comm=COMM, rank=r, size=RANKS, global_rank=r))
    start = dict.fromkeys(range(RANKS), 0.0)  # each rank's clock: where its next step starts
    seq = 0
    for step in range(1, steps + 1):
        scale = {r: SLOW if r == SLOW_RANK else 1.0 for r in range(RANKS)}
        warm = WARMUP if step == 1 else 0.0
        fwd_end = {r: start[r] + warm + FWD * scale[r] for r in range(RANKS)}
        bwd_end = {r: fwd_end[r] + BWD * scale[r] for r in range(RANKS)}
        ready1 = {r: fwd_end[r] + BWD * scale[r] / 2 for r in range(RANKS)}
        s1 = max(ready1.values())
        e1 = s1 + BUCKET1
        s2 = max(max(bwd_end.values()), e1)
        e2 = s2 + BUCKET2
        for seq_, t0, t1 in ((seq + 1, s1, e1), (seq + 2, s2, e2)):
            for r in range(RANKS):
                out.append(s.CollectiveEnqueued(t=at(), comm=COMM, seq=seq_, rank=r, op=s.CollOp.ALLREDUCE,
                                                numel=NUMEL, dtype="float32", device=r))
            out.append(s.CollectiveStarted(t=at(), comm=COMM, seq=seq_, op=s.CollOp.ALLREDUCE,
                                           total_bytes=4 * NUMEL * RANKS))
            if exec_mode == "clocked":
                out.append(s.CollectiveCompleted(t=at(), comm=COMM, seq=seq_, op=s.CollOp.ALLREDUCE,
                                                 total_bytes=4 * NUMEL * RANKS, seconds=0.01,
                                                 emulated_start=t0, emulated_end=t1, algo=ALGO))
            else:
                out.append(s.CollectiveCompleted(t=at(), comm=COMM, seq=seq_, op=s.CollOp.ALLREDUCE,
                                                 total_bytes=4 * NUMEL * RANKS, seconds=0.01))
        seq += 2
        if exec_mode != "clocked":
            continue
        for r in range(RANKS):
            end = e2 + OPT * scale[r]
            comm = BUCKET1 + BUCKET2
            overlapped = _overlap(s1, e1, fwd_end[r], bwd_end[r])
            out.append(s.ClockedStep(
                t=at(), rank=r, node=0, step=step, t_start=start[r], t_end=end,
                compute_s=warm + (FWD + BWD + OPT) * scale[r], comm_s=comm, exposed_comm_s=comm - overlapped,
                ops=120, bytes_only_ops=3))
            start[r] = end
    for r in range(RANKS):
        out.append(s.OutputLine(t=at(), rank=r, stream=s.Stream.STDOUT, text=f"[rank {r}] done"))
    out.append(s.ProcessExited(t=at(), node=0, pid=99, returncode=0))
    out.append(s.SessionEnded(t=at(), returncode=0, summary="all 1 node process(es) exited 0"))
    return out


def write_run(run_dir: str, steps: int = 6, exec_mode: str = "clocked") -> str:
    """Write the run's ``events.jsonl`` into ``run_dir`` (made if missing); return ``run_dir``."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "events.jsonl"), "wb") as f:
        for e in events(steps, exec_mode):
            f.write(s.encode(e) + b"\n")
    return run_dir
