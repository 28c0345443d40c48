"""all_reduce bandwidth: emulated RCCL (cuda tensors, through the daemon) vs gloo (CPU tensors), same run.

    python bench/allreduce_perf.py --ranks 2 4

Prints, per rank count, a table in the shape of nccl-tests' all_reduce_perf
(size, count, type, time, algbw, busbw) for both, with the ratio of bus
bandwidths; the machine's memcpy bandwidth measured in the same run (the
physical ceiling of a shared-memory transport); and the daemon's CPU time per
GB reduced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def run(ranks: int) -> tuple[list[dict], float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        r = subprocess.run(
            [sys.executable, "-m", "mirage_tui", "run", "--log-dir", tmp, "--gpus-per-node", str(ranks), "--",
             "torchrun", "--standalone", f"--nproc_per_node={ranks}", str(ROOT / "bench/allreduce_worker.py")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
        )
        if r.returncode != 0:
            raise SystemExit(f"benchmark run failed ({r.returncode}):\n{r.stderr[-3000:]}")
        rows = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("[0] {")]
        (run_dir,) = Path(tmp).iterdir()
        m = re.search(r"cpu seconds: ([\d.]+)", (run_dir / "daemon.log").read_text())
        return rows, float(m.group(1)) if m else None


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n}{unit}"
        n //= 1024
    return f"{n}TiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    a = p.parse_args()
    ceiling = memcpy_gbps()
    print(f"memcpy bandwidth (numpy, 256 MiB, this machine): {ceiling:.2f} GB/s")
    for ranks in a.ranks:
        rows, cpu = run(ranks)
        factor = 2 * (ranks - 1) / ranks  # busbw = algbw x 2(n-1)/n, as nccl-tests define it
        print(f"\n# all_reduce, {ranks} ranks, float sum (emulated nccl on cuda vs gloo on cpu)")
        print(f"{'size':>9} {'count':>10} {'type':>6} | {'nccl us':>10} {'algbw':>7} {'busbw':>7} | "
              f"{'gloo us':>10} {'algbw':>7} {'busbw':>7} | {'busbw x':>7} {'of memcpy':>9}")
        total_bytes = 0.0
        for row in rows:
            n = row["bytes"]
            alg_n, alg_g = n / row["nccl_s"] / 1e9, n / row["gloo_s"] / 1e9
            print(f"{human(n):>9} {row['count']:>10} {'float':>6} | {row['nccl_s'] * 1e6:10.1f} {alg_n:7.2f} "
                  f"{alg_n * factor:7.2f} | {row['gloo_s'] * 1e6:10.1f} {alg_g:7.2f} {alg_g * factor:7.2f} | "
                  f"{alg_n / alg_g:7.2f} {alg_n * factor / ceiling:8.0%}")
            total_bytes += n
        if cpu is not None:
            print(f"daemon CPU time: {cpu:.2f} s for the whole run (all sizes, warm-ups and iterations)")


if __name__ == "__main__":
    main()
