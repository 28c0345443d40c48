"""What starting a rank costs: CPU from the process's start (or its fork) to ``init_process_group`` done,
and the rank's private memory then, for mirage's forked ranks, mirage's fresh ones and plain CPU torch
with gloo, one torchrun job of N ranks each, in one run.

    python bench/rank_startup.py [--ranks 8] [--rounds 2]

A rank reads its own CPU with ``getrusage`` (a forked child's count starts at its fork) and its private
memory (USS) from ``/proc/self/smaps_rollup``, then checks one all-reduce. Nothing here asserts a time:
it prints medians over the ranks, and each figure's ratio to gloo's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r'''
import os, resource, sys
import torch
import torch.distributed as dist
backend = sys.argv[1]
dist.init_process_group(backend)
ru = resource.getrusage(resource.RUSAGE_SELF)
cpu = ru.ru_utime + ru.ru_stime
device = "cuda" if backend == "nccl" else "cpu"
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
t = torch.ones(4, device=device)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
with open("/proc/self/smaps_rollup") as f:
    uss = sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty"))) / 1024
print(f"STARTUP cpu={cpu:.4f} uss={uss:.1f} forked={bool(os.environ.get('MIRAGE_FORKED_AS'))}", flush=True)
dist.destroy_process_group()
'''

_LINE = re.compile(r"STARTUP cpu=([0-9.]+) uss=([0-9.]+) forked=(True|False)")


def _run(kind: str, ranks: int, probe: str) -> list[tuple[float, float, bool]]:
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", probe]
    if kind == "gloo":
        cmd = [sys.executable, *torchrun, "gloo"]
    else:
        cmd = [sys.executable, "-m", "mirage_tui", "run", "--gpus-per-node", str(ranks), "--fork-server",
               "on" if kind == "forked" else "off", "--", "python", *torchrun, "nccl"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    found = [(float(c), float(u), f == "True") for c, u, f in _LINE.findall(out.stdout)]
    if out.returncode != 0 or len(found) != ranks:
        sys.exit(f"rank_startup: {kind} run failed (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="each kind runs this many times, alternating")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.py")
        Path(probe).write_text(PROBE)
        got: dict[str, list[tuple[float, float, bool]]] = {"forked": [], "fresh": [], "gloo": []}
        for _ in range(args.rounds):
            for kind in got:
                got[kind] += _run(kind, args.ranks, probe)
    load = os.getloadavg()[0]
    gloo_cpu = statistics.median(c for c, _u, _f in got["gloo"])
    gloo_uss = statistics.median(u for _c, u, _f in got["gloo"])
    print(f"{args.ranks} ranks x {args.rounds} rounds, load {load:.1f}; medians over the ranks")
    print(f"{'':>8} {'CPU to world formed':>20} {'÷ gloo':>7} {'rank USS MiB':>13} {'÷ gloo':>7}  forked")
    for kind, rows in got.items():
        cpu = statistics.median(c for c, _u, _f in rows)
        uss = statistics.median(u for _c, u, _f in rows)
        forked = sum(f for _c, _u, f in rows)
        print(f"{kind:>8} {cpu:>19.3f}s {cpu / gloo_cpu:>7.2f} {uss:>13.1f} {uss / gloo_uss:>7.2f}  {forked}/{len(rows)}")


if __name__ == "__main__":
    main()
