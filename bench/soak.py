"""The never-stall soak: long DDP training and a mixed-collective storm under mirage.

    python bench/soak.py --ddp-steps 1000 --ranks 4 --mixed-iters 2000

1. DDP: tests/fixtures/ml/ddp_mlp.py for --ddp-steps steps on --ranks ranks; it
   must finish with identical replicas (the seed system stalled after a few steps).
2. Mixed: bench/soak_worker.py — random sizes, ops and dtypes, sync and async,
   on the default group and a subgroup, every result checked.
Prints wall time and collectives completed for each; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mirage(ranks: int, script: Path, env: dict[str, str]) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        full_env = dict(os.environ, **env, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        start = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "mirage_tui", "run", "--log-dir", tmp, "--gpus-per-node", str(ranks), "--",
             "torchrun", "--standalone", f"--nproc_per_node={ranks}", str(script)],
            cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=3600,
        )
        took = time.monotonic() - start
        if r.returncode != 0:
            raise SystemExit(f"{script.name} failed with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        (run_dir,) = Path(tmp).iterdir()
        done = sum(1 for line in (run_dir / "events.jsonl").open() if '"type":"coll_completed"' in line)
        print(r.stdout.strip().splitlines()[-1])
        return took, done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ddp-steps", type=int, default=1000)
    p.add_argument("--mixed-iters", type=int, default=2000)
    a = p.parse_args()
    took, done = mirage(a.ranks, ROOT / "tests/fixtures/ml/ddp_mlp.py", {"STEPS": str(a.ddp_steps)})
    print(json.dumps({"soak": "ddp", "ranks": a.ranks, "steps": a.ddp_steps, "wall_s": round(took, 1),
                      "collectives": done}))
    took, done = mirage(a.ranks, ROOT / "bench/soak_worker.py", {"SOAK_ITERS": str(a.mixed_iters)})
    print(json.dumps({"soak": "mixed", "ranks": a.ranks, "iters": a.mixed_iters, "wall_s": round(took, 1),
                      "collectives": done}))


if __name__ == "__main__":
    main()
