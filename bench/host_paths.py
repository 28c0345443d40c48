"""All-reduce inside a host and across hosts in a multi-host run, against gloo over the same ranks.

    python bench/host_paths.py             # needs root, ip netns, slurm-wlm and munge (as tests/multihost)

Builds a 2-host Slurm cluster of network namespaces (``tests/multihost/cluster.py``)
and runs ``mirage run --launcher slurm --gpus-per-node 2 --nproc-per-node 2 --
python bench/host_paths_worker.py`` in it twice: as mirage runs it (a ``tp`` pair,
both ranks on one host, is served by that host's daemon over shared memory; a
``dp`` pair, one rank per host, by the head's daemon over TCP), and with
``HOST_PATHS_VIA_HEAD=1`` (every communicator through the head's daemon, as
before hosts had daemons of their own). Prints, per size, the milliseconds per
all-reduce of each and the ratio to gloo over the same two ranks in the same run.
Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multihost"))

from cluster import Cluster, unavailable_reason  # noqa: E402


def run(c: Cluster, via_head: bool) -> list[dict]:
    """Rank 0's rows of one run."""
    with tempfile.TemporaryDirectory() as logs:
        env = "HOST_PATHS_VIA_HEAD=1" if via_head else ""
        script = (f"cd {REPO} && {env} mirage run --launcher slurm --log-dir {logs} --gpus-per-node 2 "
                  f"--nproc-per-node 2 -- python bench/host_paths_worker.py")
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        r = c.salloc(script, nodes=2, timeout=600, env={"PATH": path})
        if r.returncode != 0:
            sys.exit(f"the run failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        return [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("[0] {")]


def main() -> int:
    reason = unavailable_reason()
    if reason:
        print(f"host_paths: cannot build a cluster here: {reason}", file=sys.stderr)
        return 2
    with Cluster(2) as c:
        own, head = run(c, via_head=False), run(c, via_head=True)
    print(f"{'size':>8}  {'pair':<22} {'mirage ms':>10} {'gloo ms':>9} {'ratio':>6}   "
          f"{'via head ms':>11} {'ratio':>6}")
    for a, b in zip(own, head):
        size = f"{a['bytes'] >> 10} KiB" if a["bytes"] < 1 << 20 else f"{a['bytes'] >> 20} MiB"
        for pair, what in (("tp", "inside a host (shm)"), ("dp", "across hosts (TCP)")):
            m, g, h, hg = (a[f"{pair}_nccl_s"], a[f"{pair}_gloo_s"], b[f"{pair}_nccl_s"], b[f"{pair}_gloo_s"])
            print(f"{size:>8}  {what:<22} {m * 1e3:>10.3f} {g * 1e3:>9.3f} {m / g:>6.2f}   "
                  f"{h * 1e3:>11.3f} {h / hg:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
