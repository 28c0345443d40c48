"""Time CPU-bound training steps on DEVICE (argv[1]: cpu, or cuda under mirage). Driven by dispatch_overhead.py.

Each model's step is timed over several windows of a few steps; the best
window is reported (ms per step), since other jobs on the machine only ever
add time.
"""

import json
import sys
import time

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def block() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)


def make_step(make, shape, device: str):
    """One AdamW training step of ``make()`` on ``device``, warmed up (three steps taken)."""
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(*shape, device=device)

    def step():
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(3):
        step()
    return step


def per_call(fn, calls: int, clock=time.perf_counter) -> float:
    """Seconds per call of ``fn`` over one window of ``calls`` calls, by ``clock``."""
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def step_time(make, shape, device: str, steps: int, windows: int) -> float:
    step = make_step(make, shape, device)
    return min(per_call(step, steps) for _ in range(windows))


if __name__ == "__main__":
    torch.set_num_threads(1)  # one core each way: the comparison is of dispatch, not of thread scheduling
    device = sys.argv[1]
    windows = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    for name, make, shape, steps in (("mlp", mlp, (64, 256), 10), ("transformer_block", block, (8, 64, 256), 5)):
        ms = step_time(make, shape, device, steps, windows) * 1e3
        print(json.dumps({"model": name, "device": device, "ms": ms}), flush=True)
