"""all_reduce bandwidth: emulated RCCL (cuda tensors, through the daemon) vs gloo (CPU tensors), same run.

    python bench/allreduce_perf.py --ranks 2 4
    python bench/allreduce_perf.py --ranks 2 --transport shm socket --max-bytes 64MiB
    python bench/allreduce_perf.py --ranks 2 4 8 --min-bytes 64MiB --max-bytes 64MiB   # daemon CPU per GB

Prints, per rank count, a table in the shape of nccl-tests' all_reduce_perf
(size, count, type, time, algbw, busbw) for each emulated transport and for
gloo, with the ratio of bus bandwidths; the machine's memcpy bandwidth measured
in the same run (the physical ceiling of a shared-memory transport); and the
daemon's CPU time, for the whole run and per GB of all-reduced tensors (every
emulated all-reduce of the run, warm-ups included, counted once at its size,
not once per rank). ``--transport socket`` runs the emulated NCCL with
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``, so its bytes travel as ZeroMQ frames
(NET/Socket) instead of through shared memory.
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


#: what each emulated transport needs from the environment (RCCL's own switches)
TRANSPORT_ENV = {"shm": [], "socket": ["--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_SHM_DISABLE=1"]}


def run(ranks: int, transport: str, min_bytes: int, max_bytes: int) -> tuple[list[dict], float | None]:
    """One mirage run of the worker: its rows (one per size) and the daemon's CPU seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        r = subprocess.run(
            [sys.executable, "-m", "mirage_tui", "run", "--log-dir", tmp, "--gpus-per-node", str(ranks),
             "--env", f"ALLREDUCE_MIN_BYTES={min_bytes}", "--env", f"ALLREDUCE_MAX_BYTES={max_bytes}", *TRANSPORT_ENV[transport], "--",
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


def parse_bytes(text: str) -> int:
    """``64MiB``, ``2KiB``, ``8`` -> bytes."""
    m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MiB)")
    return int(m.group(1)) << {"B": 0, None: 0, "KiB": 10, "MiB": 20, "GiB": 30}[m.group(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--transport", nargs="+", choices=sorted(TRANSPORT_ENV), default=["shm"],
                   help="emulated transports to measure, one run each (gloo is measured in each run; "
                        "the table shows the first run's)")
    p.add_argument("--min-bytes", type=parse_bytes, default=0, help="smallest size (default 8B)")
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="largest size (default 256MiB)")
    a = p.parse_args()
    ceiling = memcpy_gbps()
    print(f"memcpy bandwidth (numpy, 256 MiB, this machine): {ceiling:.2f} GB/s")
    for ranks in a.ranks:
        runs = {t: run(ranks, t, a.min_bytes, a.max_bytes) for t in a.transport}
        rows = {t: rs for t, (rs, _) in runs.items()}
        gloo = rows[a.transport[0]]
        factor = 2 * (ranks - 1) / ranks  # busbw = algbw x 2(n-1)/n, as nccl-tests define it
        print(f"\n# all_reduce, {ranks} ranks, float sum (emulated nccl on cuda per transport, gloo on cpu)")
        if gloo and "rounds" in gloo[0]:
            print(f"# time per call: median of {gloo[0]['rounds']} rounds, each a block of calls per backend in turn "
                  "(min/gloo: the ratio of the fastest blocks)")
        head = f"{'size':>9} {'count':>10} {'type':>6} |"
        for t in [*a.transport, "gloo"]:
            head += f" {t + ' us':>10} {'algbw':>7} {'busbw':>7} |"
        head += "".join(f" {t + '/gloo':>11}" for t in a.transport) + f" {'best of memcpy':>14}"
        head += "".join(f" {'min ' + t + '/gloo':>15}" for t in a.transport)
        print(head)
        for i, row in enumerate(gloo):
            n = row["bytes"]
            line = f"{human(n):>9} {row['count']:>10} {'float':>6} |"
            times = [rows[t][i]["nccl_s"] for t in a.transport] + [row["gloo_s"]]
            for sec in times:
                alg = n / sec / 1e9
                line += f" {sec * 1e6:10.1f} {alg:7.2f} {alg * factor:7.2f} |"
            line += "".join(f" {row['gloo_s'] / sec:11.2f}" for sec in times[:-1])
            line += f" {n / min(times[:-1]) / 1e9 * factor / ceiling:13.0%}"
            line += "".join(f" {row['gloo_min_s'] / rows[t][i]['nccl_min_s']:15.2f}" if "gloo_min_s" in row else ""
                            for t in a.transport)
            print(line)
        for t, (rs, cpu) in runs.items():
            if cpu is not None:
                gb = sum(r["bytes"] * r["nccl_calls"] for r in rs) / 1e9
                # per GB only where large sizes dominate the run (else it is the per-call cost, spread thin)
                per_gb = f"; {cpu / gb:.3f} s per GB all-reduced ({gb:.2f} GB)" if gb >= 0.1 else ""
                print(f"daemon CPU time ({t}): {cpu:.2f} s for the whole run (all sizes, warm-ups and iterations)"
                      + per_gb)


if __name__ == "__main__":
    main()
