"""Runs inside each rank of a multi-host run (bench/host_paths.py): all-reduce inside a host and across hosts.

A ``(hosts, 2)`` mesh, as HSDP or FSDP x TP lay one out: ``tp`` pairs the two
ranks of a host, ``dp`` joins one rank of every host (its all-reduces go host
daemon to host daemon). For each size, rank 0
times an all-reduce on both, on emulated nccl/cuda and on gloo/CPU groups over
the same ranks (gloo's bytes cross the hosts' network as mirage's do), and
prints one JSON line. With ``HOST_PATHS_VIA_HEAD=1`` the rank forgets its
host's daemon before any group is made, so the ``tp`` pairs go through the
head's daemon over TCP as well: the path every communicator took before hosts
had daemons of their own.
"""

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

SIZES = [4 << 10, 256 << 10, 4 << 20, 32 << 20]
ROUNDS = 5


def timed(fn, iters: int, group) -> float:
    """Median over ``ROUNDS`` blocks of the per-call seconds of ``fn``, after two warm-up calls."""
    fn()
    fn()
    blocks = []
    for _ in range(ROUNDS):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()  # the emulated all-reduces run on their stream: the block ends when they do
        blocks.append((time.perf_counter() - start) / iters)
    return statistics.median(blocks)


def main() -> None:
    if os.environ.get("HOST_PATHS_VIA_HEAD") == "1":
        import dataclasses

        from shim.rank.runtime import RUNTIME

        # the shim reads its settings once: take this host's daemon out of them, not out of the environment
        RUNTIME.settings = dataclasses.replace(RUNTIME.settings, host_endpoint="")
        RUNTIME._host_client = None  # connected when the rank registered
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    groups = {"tp": mesh["tp"].get_group(), "dp": mesh["dp"].get_group()}
    # the same ranks on gloo: the mesh's rows are the tp pairs, its columns the dp groups (new_group is
    # collective: every rank makes every group, in the same order)
    gloo = {}
    for name, layout in (("tp", mesh.mesh.tolist()), ("dp", mesh.mesh.t().tolist())):
        for ranks in layout:
            g = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                gloo[name] = g
    for nbytes in SIZES:
        count = nbytes // 4
        iters = max(3, min(50, (16 << 20) // nbytes))
        row = {"bytes": nbytes, "iters": iters, "rounds": ROUNDS, "via_head": os.environ.get("HOST_PATHS_VIA_HEAD") == "1"}
        for name, group in groups.items():
            x, c = torch.zeros(count, device="cuda"), torch.zeros(count)  # zeros: sums never overflow
            row[f"{name}_nccl_s"] = timed(lambda: dist.all_reduce(x, group=group), iters, group)
            row[f"{name}_gloo_s"] = timed(lambda: dist.all_reduce(c, group=gloo[name]), iters, gloo[name])
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
