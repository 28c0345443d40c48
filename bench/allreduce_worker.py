"""Runs inside each rank (under mirage): time all_reduce on emulated nccl/cuda and on gloo/CPU.

Launched by bench/allreduce_perf.py; rank 0 prints one JSON line per size.
"""

import json
import os
import time

import torch
import torch.distributed as dist

SIZES = sorted([8 << (2 * i) for i in range(13)] + [64 << 20, 256 << 20])  # 8 B ... 256 MiB, and issue 4's 64 MiB
#: the sizes to time (bench/allreduce_perf.py --min-bytes, --max-bytes)
MIN_BYTES = int(os.environ.get("ALLREDUCE_MIN_BYTES", "0"))
MAX_BYTES = int(os.environ.get("ALLREDUCE_MAX_BYTES", str(SIZES[-1])))


def timed(fn, iters: int) -> float:
    fn()  # warm-up (and, for nccl, the arena growth)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    gloo = dist.new_group(backend="gloo")
    for nbytes in (n for n in SIZES if MIN_BYTES <= n <= MAX_BYTES):
        count = max(1, nbytes // 4)
        iters = max(4, min(200, (64 << 20) // max(nbytes, 1)))
        x = torch.ones(count, device="cuda")
        c = torch.ones(count)
        t_nccl = timed(lambda: dist.all_reduce(x), iters)
        t_gloo = timed(lambda: dist.all_reduce(c, group=gloo), iters)
        if rank == 0:
            print(json.dumps({"bytes": count * 4, "count": count, "world": world, "nccl_s": t_nccl, "gloo_s": t_gloo,
                              "nccl_calls": iters + 1}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
