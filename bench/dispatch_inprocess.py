"""Native vs emulated cuda training steps in one process, windows alternating: an A/B with less noise.

    python bench/dispatch_inprocess.py [--shim CHECKOUT] [--clock cpu] [--rounds N]

Activates the shim of CHECKOUT (default: this one) in this process, as a
``mirage run --in-process`` rank does, so two versions of the shim can be
compared from one tree. The native steps run on CPU tensors with the shim's
TorchFunctionMode popped, so they are plain torch; the emulated ones on cuda
tensors. Both models of bench/dispatch_worker.py are built once and their
windows alternate for N rounds; each figure is the best window. ``--clock
cpu`` times with the process's CPU time, which leaves out time the machine's
other jobs take from it.

A checkout whose C++ sources differ builds its own copy of the shim's C++
libraries and removes this one's from the shared cache, which the next run
rebuilds: give it its own cache, e.g.
``MIRAGE_CACHE_DIR=/tmp/old-cache python bench/... --shim OLD``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from dispatch_worker import block, make_step, mlp, per_call

ROOT = Path(__file__).resolve().parent.parent


def native(fn):
    """``fn()`` with the shim's mode popped: plain torch on CPU tensors."""
    mode = torch._C._pop_torch_function_stack()
    try:
        return fn()
    finally:
        torch._C._push_on_torch_function_stack(mode)


def activate_shim(checkout: str) -> None:
    """Activate ``checkout``'s shim in this process, as a ``mirage run --in-process`` rank does; one thread."""
    os.environ["MIRAGE_IN_PROCESS"] = "1"
    sys.path.insert(0, os.path.abspath(checkout))
    from shim.activate import activate

    activate()
    torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shim", default=str(ROOT), help="the checkout whose shim to activate")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--rounds", type=int, default=8)
    opts = parser.parse_args()
    clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    activate_shim(opts.shim)
    steps = {}
    for name, make, shape, n in (("mlp", mlp, (64, 256), 20), ("transformer_block", block, (8, 64, 256), 10)):
        steps[name, "native"] = (native(lambda: make_step(make, shape, "cpu")), n)
        steps[name, "cuda"] = (make_step(make, shape, "cuda"), n)
    best: dict = {}
    for _ in range(opts.rounds):
        for key, (step, n) in steps.items():
            def window():
                return per_call(step, n, clock) * 1e3

            ms = native(window) if key[1] == "native" else window()
            best[key] = min(best.get(key, float("inf")), ms)
    for name in ("mlp", "transformer_block"):
        print(json.dumps({"model": name, "native_ms": round(best[name, "native"], 2),
                          "cuda_ms": round(best[name, "cuda"], 2),
                          "ratio": round(best[name, "cuda"] / best[name, "native"], 3)}), flush=True)


if __name__ == "__main__":
    main()
