"""Per-op cost on emulated cuda: a few small ops and tiny backward passes, process CPU time.

    python bench/dispatch_ops.py [--shim CHECKOUT]

Activates CHECKOUT's shim in this process (default: this one), as
bench/dispatch_inprocess.py does, and times each op on 4-element tensors
(best of 9 × 300 calls, after 50 to warm up), so that two versions of the shim
can be compared op by op. Prints microseconds per call.

A checkout whose C++ sources differ builds its own copy of the shim's C++
libraries and removes this one's from the shared cache, which the next run
rebuilds: give it its own cache, e.g.
``MIRAGE_CACHE_DIR=/tmp/old-cache python bench/... --shim OLD``.
"""

from __future__ import annotations

import argparse
import time

import torch
from dispatch_inprocess import ROOT, activate_shim
from dispatch_worker import per_call


def bench(name: str, fn, n: int = 300, reps: int = 9) -> None:
    per_call(fn, 50)  # warm-up
    best = min(per_call(fn, n, time.process_time) for _ in range(reps))
    print(f"{name:32s} {best * 1e6:8.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shim", default=str(ROOT), help="the checkout whose shim to activate")
    activate_shim(parser.parse_args().shim)
    w = torch.randn(4, 4, device="cuda", requires_grad=True)
    x = torch.randn(4, 4, device="cuda")
    lin = torch.nn.Linear(64, 64).cuda()
    inp = torch.randn(8, 64, device="cuda")
    bench("(w * 2).sum().backward()", lambda: (w * 2).sum().backward())
    bench("linear(8x64) fwd+bwd", lambda: lin(inp).sum().backward())
    bench("w * 2 (w requires grad)", lambda: w * 2)
    bench("w.view(16) (requires grad)", lambda: w.view(16))
    bench("x.view(16)", lambda: x.view(16))
    bench("x + x", lambda: x + x)


if __name__ == "__main__":
    main()
