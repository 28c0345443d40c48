"""A rank that floods its output, timed through the whole session: every line must reach the journal.

    python bench/output_flood.py --out-mib 200 --line-mib 10

Runs ``mirage run`` on tests/reliability/workloads/big_output.py (no torch):
``--out-mib`` MiB of 100-byte lines, then one ``--line-mib`` MiB line without a
newline. Checks that rank-0.log and events.jsonl hold everything (the long
line in 64 KiB pieces), and prints the wall time and the session's peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-mib", type=float, default=200)
    p.add_argument("--line-mib", type=float, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        start = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "mirage_tui", "run", "--log-dir", tmp, "--env", f"OUT_MB={a.out_mib}",
             "--env", f"LINE_MB={a.line_mib}", "--", "python",
             str(ROOT / "tests" / "reliability" / "workloads" / "big_output.py")],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=3600,
        )
        took = time.monotonic() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB -> MiB, largest child
        if r.returncode != 0:
            raise SystemExit(f"failed with {r.returncode}: {r.stderr[-2000:]}")
        (run_dir,) = Path(tmp).iterdir()
        lines = int(a.out_mib * (1 << 20)) // 100
        long_bytes = int(a.line_mib * (1 << 20))
        pieces = -(-long_bytes // (1 << 16))
        log = (run_dir / "rank-0.log").stat().st_size
        want_log = lines * 100 + long_bytes + pieces + len(f"flood done: {lines} lines\n")
        journal = run_dir / "events.jsonl"
        n_events = sum(1 for _ in journal.open("rb"))
        ok = log == want_log and n_events >= lines + pieces
        print(f"{a.out_mib:g} MiB in {lines} lines + a {a.line_mib:g} MiB line: {took:.1f} s through mirage "
              f"({a.out_mib / took:.1f} MiB/s, {lines / took:.0f} lines/s); peak RSS of the session {peak:.0f} MiB; "
              f"rank-0.log {log} bytes ({'complete' if log == want_log else f'expected {want_log}'}), "
              f"events.jsonl {n_events} events, {journal.stat().st_size >> 20} MiB")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
