"""Where a compiled training step's time goes, part by part, on emulated GPUs and natively, in one process.

    python bench/compile_parts.py [--model mlp|"attention block"] [--eager] [--rounds R] [--steps N]
    python bench/compile_parts.py --calls [--rounds R]

Activates the shim in this process (as a ``mirage run --in-process`` rank
does), builds bench/compile_speed.py's model twice, on ``cuda`` (emulated) and
on the CPU with the shim's mode off the stack (native), compiles both (unless
``--eager``) and times each part of bench/compile_speed.py's step with this
thread's CPU time: ``zero_grad``, the forward (the compiled call), the loss,
``backward()``, the optimizer's step, and dropping the step's tensors. Windows
of N steps alternate between the two, R rounds; the figures are means over all
steps, microseconds per step, and the difference is what the emulated GPU adds
to each part (issue 28's gap, docs/performance.md "torch.compile").

``--calls`` times instead the calls such a step is made of, on an emulated
tensor and on a CPU one, the mode off the stack: ops through Python
``__torch_dispatch__``, the allocator's books for one output, AOTAutograd's
wrapping of one output (best of R rounds of 5000 calls, thread CPU time, µs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("zero_grad", "forward", "loss", "backward", "opt.step", "drop", "step")


def timed_step(model, x):
    """bench/compile_speed.py's step, timed part by part: the step, and the nanoseconds spent in each part."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    spent = dict.fromkeys(PARTS, 0)
    clock = time.thread_time_ns

    def step():
        t0 = clock()
        opt.zero_grad()
        t1 = clock()
        y = model(x)
        t2 = clock()
        loss = y.square().mean()
        t3 = clock()
        loss.backward()
        t4 = clock()
        opt.step()
        t5 = clock()
        del y, loss
        t6 = clock()
        for part, ns in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t6 - t0)):
            spent[part] += ns

    return step, spent


def calls(rounds: int) -> None:
    """``--calls``: each call on an emulated tensor and on a host one (the mode already off the stack)."""
    import torch

    from shim.rank.runtime import RUNTIME
    from shim.tensor.wrapper import MirageTensor

    books = RUNTIME.allocator
    host = torch.randn(32, 256)
    gpu = MirageTensor(host.clone(), 0)
    scalar_host, scalar_gpu = host.sum(), gpu.sum()

    def held():
        books.release(books.hold(host, 0))
        books.sync()

    ways = {
        "ones_like(loss)": (lambda: torch.ones_like(scalar_gpu), lambda: torch.ones_like(scalar_host)),
        "_foreach_add_, 2 tensors": (lambda: torch._foreach_add_([gpu, gpu], [gpu, gpu], alpha=0.0),
                                     lambda: torch._foreach_add_([host, host], [host, host], alpha=0.0)),
        "add_(x, alpha=)": (lambda: gpu.add_(gpu, alpha=0.0), lambda: host.add_(host, alpha=0.0)),
        "allocator hold+release": (held, None),
        "__tensor_unflatten__": (lambda: MirageTensor.__tensor_unflatten__({"_elem": host}, 0, None, None), None),
    }

    def per_call(fn) -> float:
        start = time.thread_time_ns()
        for _ in range(5000):
            fn()
        return (time.thread_time_ns() - start) / 5000 / 1e3

    print(f"us per call (best of {rounds} rounds of 5000, thread CPU time); load {os.getloadavg()[0]:.1f}")
    print(f"{'call':>26} {'emulated':>9} {'host':>6}")
    for name, (on_gpu, on_host) in ways.items():
        e = min(per_call(on_gpu) for _ in range(rounds))
        h = f"{min(per_call(on_host) for _ in range(rounds)):6.2f}" if on_host else f"{'-':>6}"
        print(f"{name:>26} {e:9.2f} {h}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "attention block"))
    parser.add_argument("--eager", action="store_true", help="time the eager step instead of the compiled one")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--calls", action="store_true", help="time single calls instead of a step's parts")
    opts = parser.parse_args()
    os.environ["MIRAGE_IN_PROCESS"] = "1"
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch

    from shim.activate import activate

    activate()
    torch.set_num_threads(1)
    from compile_speed import build
    from dispatch_inprocess import native  # fn() with the shim's mode off the stack: plain CPU torch

    def make(device: str):
        model, x = build(opts.model, device)
        return timed_step(model if opts.eager else torch.compile(model), x)

    if opts.calls:
        native(lambda: calls(opts.rounds))
        return
    emulated, emulated_spent = make("cuda")
    host, host_spent = native(lambda: make("cpu"))

    def window(step):
        for _ in range(opts.steps):
            step()

    for _ in range(3):  # warm-up: the compiles
        emulated()
        native(host)
    for spent in (emulated_spent, host_spent):
        spent.update(dict.fromkeys(PARTS, 0))
    load = os.getloadavg()[0]
    for _ in range(opts.rounds):
        window(emulated)
        native(lambda: window(host))
    n = opts.rounds * opts.steps
    print(f"{opts.model}, {'eager' if opts.eager else 'compiled'}: us per step (thread CPU time, mean of {n}); "
          f"load {load:.1f} to {os.getloadavg()[0]:.1f}")
    print(f"{'part':>10} {'emulated':>9} {'native':>9} {'added':>8}")
    for part in PARTS:
        e, h = emulated_spent[part] / n / 1e3, host_spent[part] / n / 1e3
        print(f"{part:>10} {e:9.1f} {h:9.1f} {e - h:8.1f}")
    print(f"{'ratio':>10} {emulated_spent['step'] / host_spent['step']:9.3f}")


if __name__ == "__main__":
    main()
