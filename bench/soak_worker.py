"""Inside each rank: a seeded storm of collectives of random size, op and dtype, each result checked."""

import os
import random

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
evens = dist.new_group(list(range(0, world, 2)))
rng = random.Random(1234)  # the same sequence on every rank
for i in range(int(os.environ.get("SOAK_ITERS", "2000"))):
    n = rng.choice([1, 7, 64, 1000, 4096, 65536, 1 << 20])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.float16])
    kind = rng.choice(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "async", "subgroup"])
    if kind in ("all_reduce", "async"):
        t = torch.full((n,), rank + 1, dtype=dtype, device="cuda")
        work = dist.all_reduce(t, async_op=kind == "async")
        if work is not None:
            work.wait()
        want = float(world * (world + 1) // 2)
        assert t[0].item() == want and t[-1].item() == want, (i, kind, t[0].item())
    elif kind == "broadcast":
        src = i % world
        t = torch.full((n,), rank, dtype=dtype, device="cuda")
        dist.broadcast(t, src=src)
        assert t[-1].item() == src, (i, kind)
    elif kind == "all_gather":
        out = torch.empty(n * world, dtype=dtype, device="cuda")
        dist.all_gather_into_tensor(out, torch.full((n,), rank, dtype=dtype, device="cuda"))
        assert out[::n].tolist() == list(range(world)), (i, kind)
    elif kind == "reduce_scatter":
        out = torch.empty(n, dtype=dtype, device="cuda")
        dist.reduce_scatter_tensor(out, torch.ones(n * world, dtype=dtype, device="cuda"))
        assert out[0].item() == world, (i, kind)
    elif rank % 2 == 0:
        t = torch.ones(n, dtype=dtype, device="cuda")
        dist.all_reduce(t, group=evens)
        assert t[0].item() == len(range(0, world, 2)), (i, kind)
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    print("soak_ok", flush=True)
