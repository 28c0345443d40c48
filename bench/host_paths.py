"""Collectives inside a host and across hosts in a multi-host run, against gloo over the same ranks.

    python bench/host_paths.py             # needs root, ip netns, slurm-wlm and munge (as tests/multihost)
    python bench/host_paths.py --hosts 4 --no-via-head

Builds a Slurm cluster of ``--hosts`` network namespaces (``tests/multihost/cluster.py``)
and runs ``mirage run --launcher slurm --gpus-per-node 2 --nproc-per-node 2 --
python bench/host_paths_worker.py`` in it twice: as mirage runs it (a ``tp`` pair,
both ranks on one host, is served by that host's daemon over shared memory; a
``dp`` group, one rank per host, by the hosts' daemons, which exchange its data
among themselves while the head's daemon keeps its books: at every size, with
``MIRAGE_ACROSS_HOSTS_MIN_BYTES=0``), and with
``HOST_PATHS_VIA_HEAD=1`` (every communicator through the head's daemon, as
before hosts had daemons of their own). Prints, per collective (all-reduce at
4 KiB to 32 MiB; all-gather and reduce-scatter at 4 and 32 MiB, the size being
the whole buffer) and size, the milliseconds per call of each and the ratio to
gloo over the same ranks in the same run.
Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multihost"))

from cluster import Cluster, unavailable_reason  # noqa: E402


def run(c: Cluster, via_head: bool, hosts: int) -> list[dict]:
    """Rank 0's rows of one run."""
    with tempfile.TemporaryDirectory() as logs:
        # every size host daemon to host daemon (by default only from 256 KiB), so each row times that path
        env = "HOST_PATHS_VIA_HEAD=1" if via_head else "MIRAGE_ACROSS_HOSTS_MIN_BYTES=0"
        script = (f"cd {REPO} && {env} mirage run --launcher slurm --log-dir {logs} --gpus-per-node 2 "
                  f"--nproc-per-node 2 -- python bench/host_paths_worker.py")
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        r = c.salloc(script, nodes=hosts, timeout=600, env={"PATH": path})
        if r.returncode != 0:
            sys.exit(f"the run failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        return [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("[0] {")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=2, help="hosts of the cluster, 2 ranks each (default 2)")
    ap.add_argument("--no-via-head", action="store_true", help="skip the run with every communicator through the head")
    a = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"host_paths: cannot build a cluster here: {reason}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    with Cluster(a.hosts) as c:
        own = run(c, via_head=False, hosts=a.hosts)
        head = own if a.no_via_head else run(c, via_head=True, hosts=a.hosts)
    # the box's load, before and after: the figures move with it (other jobs share its cores)
    print(f"{a.hosts} hosts; across hosts: one rank per host; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'op':<15} {'size':>8}  {'group':<22} {'mirage ms':>10} {'gloo ms':>9} {'ratio':>6}   "
          + ("" if a.no_via_head else f"{'via head ms':>11} {'ratio':>6}"))
    for mine, theirs in zip(own, head):
        size = f"{mine['bytes'] >> 10} KiB" if mine["bytes"] < 1 << 20 else f"{mine['bytes'] >> 20} MiB"
        for pair, what in (("tp", "inside a host (shm)"), ("dp", "across hosts (TCP)")):
            m, g, h, hg = (mine[f"{pair}_nccl_s"], mine[f"{pair}_gloo_s"], theirs[f"{pair}_nccl_s"],
                           theirs[f"{pair}_gloo_s"])
            print(f"{mine['op']:<15} {size:>8}  {what:<22} {m * 1e3:>10.3f} {g * 1e3:>9.3f} {m / g:>6.2f}   "
                  + ("" if a.no_via_head else f"{h * 1e3:>11.3f} {h / hg:>6.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
