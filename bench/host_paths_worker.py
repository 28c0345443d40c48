"""Runs inside each rank of a multi-host run (bench/host_paths.py): collectives inside a host and across hosts.

A ``(hosts, 2)`` mesh, as HSDP or FSDP x TP lay one out: ``tp`` pairs the two
ranks of a host, ``dp`` joins one rank of every host (its collectives go host
daemon to host daemon). For each collective and size, rank 0
times it on both, on emulated nccl/cuda and on gloo/CPU groups over the same
ranks (gloo's bytes cross the hosts' network as mirage's do), and prints one
JSON line. A size is the collective's whole buffer: an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input. With ``HOST_PATHS_VIA_HEAD=1`` the rank forgets its
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

#: bytes timed, per collective
SIZES = {"all_reduce": [4 << 10, 256 << 10, 4 << 20, 32 << 20], "all_gather": [4 << 20, 32 << 20],
         "reduce_scatter": [4 << 20, 32 << 20]}
ROUNDS = 5


def collective(op: str, count: int, group, device: str):
    """A call of ``op`` over ``count`` float32 elements in all on ``group``, its tensors made once (zeros: sums
    never overflow)."""
    share = count // group.size()
    if op == "all_reduce":
        x = torch.zeros(count, device=device)
        return lambda: dist.all_reduce(x, group=group)
    whole, part = torch.zeros(count, device=device), torch.zeros(share, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, part, group=group)
    return lambda: dist.reduce_scatter_tensor(part, whole, group=group)


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
    for op, sizes in SIZES.items():
        for nbytes in sizes:
            count = nbytes // 4
            iters = max(3, min(50, (16 << 20) // nbytes))
            row = {"op": op, "bytes": nbytes, "iters": iters, "rounds": ROUNDS,
                   "via_head": os.environ.get("HOST_PATHS_VIA_HEAD") == "1"}
            for name, group in groups.items():
                row[f"{name}_nccl_s"] = timed(collective(op, count, group, "cuda"), iters, group)
                row[f"{name}_gloo_s"] = timed(collective(op, count, gloo[name], "cpu"), iters, gloo[name])
            if rank == 0:
                print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
