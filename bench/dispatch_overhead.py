"""The shim's cost on every op: a CPU-bound training step natively vs on emulated cuda, same machine, one run.

    python bench/dispatch_overhead.py [--rounds N] [--windows W]

Runs bench/dispatch_worker.py three ways: plain CPU torch (no mirage), CPU
tensors inside a mirage rank (the global TorchFunctionMode's cost alone), and
emulated cuda tensors (mode + __torch_dispatch__ wrapper), the ranks with
``mirage run --in-process`` (no daemon competing for the cores). The three
alternate for N rounds and each figure is the best of its rounds (every
worker reports its best window), since other jobs on a shared machine only
ever add time. Prints ms per step and the ratio to native, and the spread of
the per-round ratios. Issue 3's target: emulated cuda <= 1.3x native.

To measure another checkout OLD, run its copy of this file from OLD with OLD
first on the path: ``cd OLD && PYTHONPATH=OLD MIRAGE_CACHE_DIR=/tmp/old-cache
python bench/dispatch_overhead.py``. Without PYTHONPATH its ranks import the
shim of the checkout the virtual environment has installed (editable), not
OLD's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench/dispatch_worker.py")


def rows(cmd: list[str]) -> dict[str, float]:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])))
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    out = {}
    for line in r.stdout.splitlines():
        line = line.removeprefix("[0] ")
        if line.startswith("{"):
            row = json.loads(line)
            out[row["model"]] = row["ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=20,
                        help="timed windows per worker, best taken (the first ones still warm caches up: with 5, "
                             "the emulated block's best came out ~10%% slower)")
    args = parser.parse_args()
    rounds, windows = args.rounds, str(args.windows)
    runs: dict[str, list[dict[str, float]]] = {"native": [], "moded": [], "emulated": []}
    with tempfile.TemporaryDirectory() as tmp:
        mirage = [sys.executable, "-m", "mirage_tui", "run", "--in-process", "--log-dir", tmp, "--", "python", WORKER]
        for _ in range(rounds):
            runs["native"].append(rows([sys.executable, WORKER, "cpu", windows]))
            runs["moded"].append(rows(mirage + ["cpu", windows]))
            runs["emulated"].append(rows(mirage + ["cuda", windows]))
    best = {way: {model: min(r[model] for r in rs) for model in rs[0]} for way, rs in runs.items()}
    print(f"{'model':>18} {'native cpu':>11} {'cpu in rank':>12} {'emulated cuda':>14} {'cuda/native':>12}"
          f" {'per round':>12}")
    for model, ms in best["native"].items():
        spread = [e[model] / n[model] for n, e in zip(runs["native"], runs["emulated"])]
        print(f"{model:>18} {ms:9.2f}ms {best['moded'][model]:10.2f}ms {best['emulated'][model]:12.2f}ms"
              f" {best['emulated'][model] / ms:11.2f}x {min(spread):6.2f}-{max(spread):.2f}x")


if __name__ == "__main__":
    main()
