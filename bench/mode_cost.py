"""What one call through the shim's TorchFunctionMode costs, against no mode and a mode that only passes it on.

    python bench/mode_cost.py [--rounds R] [--step compiled|eager]

Activates the shim in this process (as a ``mirage run --in-process`` rank
does) and times a few calls that name no device (most calls a training step
makes: an op, a tensor's attribute, ``torch.set_grad_enabled``) with the mode
stack holding nothing, a ``TorchFunctionMode`` whose ``__torch_function__``
only calls ``func`` (torch's cost of having a mode: its C++ stashes the mode,
builds the arguments, calls into Python), and ``CudaMode``
(shim/cuda/mode.py; the difference to the passthrough is its Python body).
To compare two versions of the mode, run the bench in each checkout
(``/work/tools/bench_pair.sh`` alternates them). Thread CPU time, microseconds per call,
the best of R rounds whose ways alternate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALLS = 5000


def per_call(fn) -> float:
    """Microseconds per call of ``fn`` over :data:`CALLS` calls, by this thread's CPU time."""
    start = time.thread_time()
    for _ in range(CALLS):
        fn()
    return (time.thread_time() - start) / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--step", choices=("compiled", "eager"), help="time a training step instead of calls")
    opts = parser.parse_args()
    os.environ["MIRAGE_IN_PROCESS"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.overrides import TorchFunctionMode

    from shim.activate import activate

    activate()
    torch.set_num_threads(1)
    from shim.rank.runtime import RUNTIME

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    modes = {"no mode": None, "passthrough": Passthrough()}
    modes["CudaMode"] = RUNTIME.cuda.mode  # the installed one, which compiled functions take off the stack

    def under(mode, fn):
        """``fn()`` with ``mode`` (None: none) in place of the shim's mode."""
        installed = torch._C._pop_torch_function_stack()  # the shim's own, put back after
        try:
            if mode is None:
                return fn()
            torch._C._push_on_torch_function_stack(mode)
            try:
                return fn()
            finally:
                torch._C._pop_torch_function_stack()
        finally:
            torch._C._push_on_torch_function_stack(installed)

    if opts.step:
        step_ratios(opts, modes, under)
        return
    a, b = torch.randn(4), torch.randn(4)
    ga, gb = a.cuda(), b.cuda()
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    calls = {
        "torch.add(a, b), host": lambda: torch.add(a, b),
        "p.grad, host": lambda: p.grad,
        "_set_grad_enabled(True)": lambda: torch._C._set_grad_enabled(True),
        "torch.add(a, b), cuda": lambda: torch.add(ga, gb),
        "a.grad, cuda": lambda: ga.grad,
    }
    print(f"{'us per call':>24} " + " ".join(f"{name:>11}" for name in modes))
    for name, fn in calls.items():
        best = dict.fromkeys(modes, float("inf"))
        for _ in range(opts.rounds):
            for way, mode in modes.items():
                best[way] = min(best[way], under(mode, lambda: per_call(fn)))
        print(f"{name:>24} " + " ".join(f"{best[way]:>11.2f}" for way in modes))


def step_ratios(opts, modes: dict, under) -> None:
    """``--step``: bench/compile_speed.py's MLP step on emulated cuda under each mode but the passthrough,
    and natively."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from compile_speed import build, stepper

    def make(device: str):
        model, x = build("mlp", device)
        return stepper(torch.compile(model) if opts.step == "compiled" else model, x)

    def window(step) -> float:
        start = time.thread_time()
        for _ in range(20):
            step()
        return (time.thread_time() - start) / 20 * 1e3

    ways = {way: (make("cuda"), mode) for way, mode in modes.items() if way not in ("no mode", "passthrough")}
    ways["no mode"] = (ways["CudaMode"][0], None)
    ways["native"] = (under(None, lambda: make("cpu")), None)
    ms: dict = {way: [] for way in ways}
    for _ in range(3):  # warm-up: compiles for each mode stack
        for step, mode in ways.values():
            under(mode, step) if mode is not modes["CudaMode"] else step()
    for _ in range(opts.rounds):
        for way, (step, mode) in ways.items():
            ms[way].append(window(step) if mode is modes["CudaMode"] else under(mode, lambda: window(step)))
    print(f"mlp step, {opts.step}: ms per step (best, median window); ratio to native (median of rounds)")
    for way, times in ms.items():
        ratio = statistics.median(t / n for t, n in zip(times, ms["native"]))
        print(f"{way:>10} {min(times):7.3f} {statistics.median(times):7.3f}  {ratio:6.3f}x")


if __name__ == "__main__":
    main()
