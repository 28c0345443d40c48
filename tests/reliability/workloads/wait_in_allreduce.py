"""Every rank all-reduces twice; then rank 0 enters a third all-reduce that rank 1 never joins.

Rank 0 announces ``waiting in all_reduce #3`` just before it blocks, so a test
can strike (kill the daemon, the agent, ...) while a collective is in flight.
"""

import os
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda")
for step in (1, 2):
    dist.all_reduce(t)
    print(f"[rank {rank}] all_reduce #{step} done: {t[0].item():g}", flush=True)
if rank == 0:
    print("[rank 0] waiting in all_reduce #3", flush=True)
    dist.all_reduce(t)
    print("[rank 0] all_reduce #3 returned (it should not have)", flush=True)
else:
    print(f"[rank {rank}] sleeping instead of all_reduce #3", flush=True)
    time.sleep(600)
