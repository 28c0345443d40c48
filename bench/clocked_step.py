"""What clocked mode adds to one training step on the rank's side, without the daemon (issue #30).

    python bench/clocked_step.py [--rounds N] [--steps S] [--callgrind]

The DDP demo's model, loss and optimizer (tests/fixtures/ml/ddp_mlp.py: a
16 → 64 → 64 → 1 MLP, MSE on 32 rows indexed from 512, Adam) on one emulated
GPU in one process, the shim activated as ``mirage run --in-process`` does
(bench/dispatch_inprocess.py), ``MIRAGE_EXEC_MODE`` functional, then clocked,
alternating for N rounds: process CPU time per step, the best of each. With
``--callgrind`` each mode runs once under valgrind's callgrind instead, which
counts the instructions of S steps alone (started and stopped around them with
``callgrind_control``): a figure other jobs on a shared machine do not move.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("functional", "clocked")


def worker(steps: int, marks: str | None) -> None:
    """In the child: warm up, then ``steps`` steps; their CPU ms per step on stdout. With ``marks`` (a
    directory) it waits for ``go`` there before them and writes ``done`` after, for callgrind to count them."""
    sys.path.insert(0, str(ROOT))
    os.environ["MIRAGE_IN_PROCESS"] = "1"
    from shim.activate import activate

    activate()
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(512, 16, device="cuda"), torch.randn(512, 1, device="cuda")
    loss_fn = nn.MSELoss()
    batches = torch.Generator().manual_seed(1)

    def step():
        idx = torch.randint(0, 512, (32,), generator=batches).cuda()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()

    for _ in range(5):
        step()
    if marks:
        Path(marks, "ready").touch()
        while not Path(marks, "go").exists():
            time.sleep(0.05)
    start = time.process_time()
    for _ in range(steps):
        step()
    print((time.process_time() - start) / steps * 1e3, flush=True)
    if marks:
        Path(marks, "done").touch()


def cpu_ms(mode: str, steps: int) -> float:
    """One child's CPU ms per step in ``mode``."""
    env = dict(os.environ, MIRAGE_EXEC_MODE=mode)
    out = subprocess.run([sys.executable, __file__, "--worker", str(steps)], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.split()[-1])


def instructions(mode: str, steps: int) -> int:
    """The instructions ``steps`` steps take in ``mode``, counted by callgrind."""
    with tempfile.TemporaryDirectory() as marks:
        out = os.path.join(marks, "callgrind.out")
        env = dict(os.environ, MIRAGE_EXEC_MODE=mode, PYTHONHASHSEED="0")
        child = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                                  sys.executable, __file__, "--worker", str(steps), "--marks", marks],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for mark in ("ready", "done"):
                while not os.path.exists(os.path.join(marks, mark)):
                    if child.poll() is not None:
                        raise SystemExit(f"the {mode} worker exited {child.returncode} under valgrind")
                    time.sleep(0.2)
                switch = "on" if mark == "ready" else "off"
                subprocess.run(["callgrind_control", "-i", switch, str(child.pid)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if mark == "ready":
                    Path(marks, "go").touch()
            child.wait(timeout=600)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        with open(out) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("totals:"))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[4] if len(sys.argv) > 4 else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--callgrind", action="store_true", help="count instructions under valgrind instead")
    args = parser.parse_args()
    if args.callgrind:
        counts = {mode: instructions(mode, args.steps) / args.steps for mode in MODES}
        print(f"instructions per step: functional {counts['functional'] / 1e6:.2f} M, clocked "
              f"{counts['clocked'] / 1e6:.2f} M: {counts['clocked'] / counts['functional']:.3f}x")
        return
    best = {mode: float("inf") for mode in MODES}
    for i in range(args.rounds):
        for mode in MODES if i % 2 == 0 else reversed(MODES):
            best[mode] = min(best[mode], cpu_ms(mode, args.steps))
    print(f"CPU ms per step (best of {args.rounds}): functional {best['functional']:.2f}, clocked "
          f"{best['clocked']:.2f}: {best['clocked'] / best['functional']:.3f}x")


if __name__ == "__main__":
    main()
