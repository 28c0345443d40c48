"""How long after the hang timeout mirage reports a hang, measured on real runs.

Runs the skip-an-all_reduce fixture N times under ``mirage run --hang-timeout T``
and reads, from each run's events.jsonl, the time from the first rank arriving
at the stuck collective to the daemon's ``hang`` event, and to the session's
finished diagnosis (``hang_report``, which includes signalling every rank for
its stacks). Prints the distribution of (latency - T).

    python bench/hang_latency.py --runs 10 --hang-timeout 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(hang_timeout: float) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        subprocess.run(
            [sys.executable, "-m", "mirage_tui", "run", "--log-dir", tmp, "--gpus-per-node", "2",
             "--hang-timeout", str(hang_timeout), "--", "torchrun", "--standalone", "--nproc_per_node=2",
             str(ROOT / "tests/fixtures/ml/skip_allreduce.py")],
            cwd=ROOT, env=env, capture_output=True, check=False, timeout=300,
        )
        (run,) = Path(tmp).iterdir()
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    hang = next(e for e in events if e["type"] == "hang")
    report = next(e for e in events if e["type"] == "hang_report")
    arrived = min(e["t"] for e in events if e["type"] == "coll_enqueued" and e["seq"] == hang["seq"])
    return hang["t"] - arrived - hang_timeout, report["t"] - arrived - hang_timeout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--hang-timeout", type=float, default=2.0)
    a = p.parse_args()
    detect, report = zip(*(one_run(a.hang_timeout) for _ in range(a.runs)))
    print(f"{a.runs} runs, --hang-timeout {a.hang_timeout:g} s; seconds after the timeout:")
    print(f"{'':>22} {'min':>7} {'median':>7} {'max':>7}")
    for name, xs in (("hang event (daemon)", detect), ("report (with stacks)", report)):
        print(f"{name:>22} {min(xs):7.3f} {statistics.median(xs):7.3f} {max(xs):7.3f}")


if __name__ == "__main__":
    main()
