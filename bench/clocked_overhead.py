"""What clocked mode costs in wall time: the same runs functional and clocked, side by side (issue #16).

    python bench/clocked_overhead.py [--rounds N] [--windows W] [--ddp-steps S]

Two workloads, each under ``mirage run`` with the daemon, ``--exec-mode
functional`` (the default, with the C++ fast dispatch) against ``--exec-mode
clocked`` (every op timed in Python, the fast dispatch off):

- the transformer-block and MLP training steps of bench/dispatch_worker.py on
  one emulated GPU: ms per step, the best of W windows (start-up left out);
- the DDP demo (tests/fixtures/ml/ddp_mlp.py, 2 ranks under torchrun, S steps
  as tests/run_ddp_mlp_mi350.sh runs it): wall time of the whole run, the CPU
  time of all its processes (on a shared machine the steadier figure), and its
  training loop alone (ms per step from its first to its last collective).

The two modes alternate for N rounds, which of them goes first alternating too,
and each figure is the best of its rounds, since other jobs on a shared machine
only ever add time. Prints each figure, clocked / functional of the best ones,
and the median and spread of the per-round ratios (a round's two runs are
neighbours in time, so their ratio sees the same load). Issue 16's target:
clocked at most 1.10x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench/dispatch_worker.py")
DDP = str(ROOT / "tests/fixtures/ml/ddp_mlp.py")
MODES = ("functional", "clocked")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], steps: int) -> tuple[str, float, float]:
    """Run ``cmd`` with the venv's tools on PATH and ``STEPS=steps``: its stdout, wall seconds, and the CPU
    seconds of its whole process tree (daemon and ranks included), which other jobs on the machine barely move."""
    env = dict(os.environ, STEPS=str(steps), PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                                                   os.environ["PATH"]]))
    cpu, start = _cpu_seconds(), time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return r.stdout, wall, cpu


def mirage(mode: str, log_dir: str) -> list[str]:
    return [sys.executable, "-m", "mirage_tui", "run", "--exec-mode", mode, "--log-dir", log_dir]


def one_round(mode: str, log_dir: str, windows: int, ddp_steps: int) -> dict[str, float]:
    """Every figure of one mode: ms per step of each worker model; the DDP demo's wall and CPU seconds and
    its training loop's ms per step."""
    out, _, _ = run(mirage(mode, log_dir) + ["--gpus-per-node", "1", "--nproc-per-node", "1", "--", "python",
                                             WORKER, "cuda", str(windows)], 0)
    figures = {}
    for line in out.splitlines():
        line = line.removeprefix("[0] ")
        if line.startswith("{"):
            row = json.loads(line)
            figures[f"{row['model']} ms/step"] = row["ms"]
    ddp_dir = tempfile.mkdtemp(dir=log_dir)  # its own, to find its run's events
    out, wall, cpu = run(mirage(mode, ddp_dir) + ["--gpus-per-node", "2", "--", "torchrun", "--standalone",
                                                  "--nproc_per_node=2", DDP], ddp_steps)
    if "[0] ddp_mlp_ok" not in out.splitlines():
        raise SystemExit(f"the DDP demo did not finish in {mode} mode:\n{out[-2000:]}")
    figures[f"ddp demo ({ddp_steps} steps) s"] = wall
    figures[f"ddp demo ({ddp_steps} steps) cpu s"] = cpu
    figures["ddp training ms/step"] = training_ms_per_step(ddp_dir, ddp_steps)
    return figures


def training_ms_per_step(log_dir: str, steps: int) -> float:
    """The DDP demo's training loop alone, from its run's events: first to last collective, per step
    (the demo's wall time is mostly start-up and tear-down, which clocked mode does not change)."""
    (run_dir,) = Path(log_dir).iterdir()
    with open(run_dir / "events.jsonl") as f:
        done = [e["t"] for e in map(json.loads, f) if e["type"] == "coll_completed"]
    return (done[-1] - done[0]) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=20, help="timed windows per worker model, best taken")
    parser.add_argument("--ddp-steps", type=int, default=50, help="the demo's steps (tests/run_ddp_mlp_mi350.sh: 50)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in MODES if i % 2 == 0 else reversed(MODES):
                runs[mode].append(one_round(mode, tmp, args.windows, args.ddp_steps))
    best = {mode: {k: min(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"{'':>28} {'functional':>11} {'clocked':>10} {'clocked/functional':>19} {'median round':>13}"
          f" {'per round':>12}")
    for key, functional in best["functional"].items():
        ratios = [c[key] / f[key] for f, c in zip(runs["functional"], runs["clocked"])]
        print(f"{key:>28} {functional:11.2f} {best['clocked'][key]:10.2f} {best['clocked'][key] / functional:18.3f}x"
              f" {statistics.median(ratios):12.3f}x {min(ratios):6.2f}-{max(ratios):.2f}x")


if __name__ == "__main__":
    main()
