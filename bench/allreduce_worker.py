"""Runs inside each rank (under mirage): time all_reduce on emulated nccl/cuda and on gloo/CPU.

Launched by bench/allreduce_perf.py; rank 0 prints one JSON line per size.

Each size is timed in ``ROUNDS`` rounds, each round one block of calls on
nccl then one on gloo, and each backend's time is the median of its blocks'
per-call means: a burst of load from elsewhere on the machine lands in one
block of one backend, not in the result, and both backends see the same
machine (the mean of one long block each was decided by whichever caught
more noise).
"""

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES = sorted([8 << (2 * i) for i in range(13)] + [64 << 10, 64 << 20, 256 << 20])  # 8 B ... 256 MiB, and issue 4's 64 KiB and 64 MiB
ROUNDS = int(os.environ.get("ALLREDUCE_ROUNDS", "5"))
#: the sizes to time (bench/allreduce_perf.py --min-bytes, --max-bytes)
MIN_BYTES = int(os.environ.get("ALLREDUCE_MIN_BYTES", "0"))
MAX_BYTES = int(os.environ.get("ALLREDUCE_MAX_BYTES", str(SIZES[-1])))


def timed(fns: dict, iters: int) -> dict[str, list[float]]:
    """Per-call seconds of each of ``fns``' blocks of ``iters`` calls, the backends taking turns, ``ROUNDS`` each."""
    for fn in fns.values():
        # warm-up: for nccl the arena's growth, and a reused tensor's move into shared memory on its second
        # collective (shim/transport/shared_buffers.py, once per buffer, as NCCL registers a user buffer)
        fn()
        fn()
    blocks: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            blocks[name].append((time.perf_counter() - start) / iters)
    return blocks


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    gloo = dist.new_group(backend="gloo")
    for nbytes in (n for n in SIZES if MIN_BYTES <= n <= MAX_BYTES):
        count = max(1, nbytes // 4)
        iters = max(2, min(100, (32 << 20) // max(nbytes, 1)))
        x = torch.ones(count, device="cuda")
        c = torch.ones(count)
        blocks = timed({"nccl": lambda: dist.all_reduce(x), "gloo": lambda: dist.all_reduce(c, group=gloo)}, iters)
        if rank == 0:
            print(json.dumps({"bytes": count * 4, "count": count, "world": world,
                              "nccl_s": statistics.median(blocks["nccl"]), "gloo_s": statistics.median(blocks["gloo"]),
                              "nccl_min_s": min(blocks["nccl"]), "gloo_min_s": min(blocks["gloo"]),
                              "rounds": ROUNDS, "iters": iters, "nccl_calls": ROUNDS * iters + 2}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
