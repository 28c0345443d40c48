"""Load on one daemon: many ranks x many small collectives, and large all-reduces, at once.

    python bench/daemon_load.py --ranks 32 --small 3000 --big-ranks 8 --big-mib 256 --big-iters 3

No torch: ranks are DEALER sockets of this process (tests/daemon_client.py), each
with its own /dev/shm arena, against a real ``python -m emulator`` daemon.

- small: ``--ranks`` ranks in one communicator post ``--small`` all-reduces of
  256 float32 each, up to ``--window`` in flight per rank (each in its own slot
  of the arena); every rank checks every reply arrives, in sequence order, and
  every result is exact. Four 8-rank sub-communicators interleave barriers.
- big (a thread, at the same time): ``--big-ranks`` ranks all-reduce
  ``--big-mib`` MiB of float32 ``--big-iters`` times, each result checked.

Prints throughput, the daemon's RSS (sampled every 50 ms) and CPU time; exits
non-zero on any lost, reordered or wrong completion.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from daemon_client import DaemonProcess, Group  # noqa: E402

from wire import schema as s  # noqa: E402

SMALL = 256  # float32 elements per small all-reduce
SLOT = 4096  # bytes per in-flight slot of a rank's arena


def run_small(d: DaemonProcess, ranks: int, n: int, window: int, out: dict) -> None:
    hosts = [f"h{r // 4}" for r in range(ranks)]
    world = Group(d, ranks, devices=[r % 4 for r in range(ranks)], hosts=hosts)
    subs = [Group(d, 8, devices=[r % 4 for r in range(8)], hosts=[f"s{k}-{r // 4}" for r in range(8)])
            for k in range(ranks // 8)]
    for r in world.ranks:
        r.ensure_arena(SLOT * window)
    poller = zmq.Poller()
    for r in world.ranks:
        poller.register(r.client.sock, zmq.POLLIN)
    expected_sum = lambda seq: float(sum(range(ranks)) + ranks * seq)  # noqa: E731
    posted = completed = barriers = 0
    next_seq = [1] * ranks  # next seq each rank posts
    done_seq = [0] * ranks  # last seq each rank saw completed
    start = time.monotonic()
    while min(done_seq) < n:
        # every rank posts what its window allows
        for i, r in enumerate(world.ranks):
            while next_seq[i] <= n and next_seq[i] - done_seq[i] <= window:
                seq = next_seq[i]
                off = (seq % window) * SLOT
                r.write(off, np.full(SMALL, i + seq, np.float32))
                r.post(s.CollOp.ALLREDUCE, SMALL, seq=seq, out_numel=SMALL, in_off=off, out_off=off)
                next_seq[i] += 1
                posted += 1
        # wait for any reply, then take all that came; each must be the next in order, and exact
        assert poller.poll(60_000), "no completion within 60 s (lost?)"
        for i, r in enumerate(world.ranks):
            while r.client.has_reply(0.0):
                rep = r.client.recv()
                assert isinstance(rep, s.Done), rep
                assert rep.seq == done_seq[i] + 1, f"rank {i}: completion {rep.seq} after {done_seq[i]} (reordered)"
                done_seq[i] = rep.seq
                value = r.read((rep.seq % window) * SLOT, SMALL, np.float32)
                assert (value == expected_sum(rep.seq)).all(), f"rank {i} seq {rep.seq}: wrong result {value[:4]}"
                completed += 1
        if posted and posted % (ranks * 100) == 0 and subs:  # sub-communicators: a barrier each, now and then
            for g in subs:
                g.run(s.CollOp.BARRIER, None)
                barriers += 1
    out["small_s"] = time.monotonic() - start
    out["small_completions"] = completed
    out["barriers"] = barriers
    assert completed == ranks * n, (completed, ranks * n)


def run_big(d: DaemonProcess, ranks: int, mib: int, iters: int, out: dict) -> None:
    g = Group(d, ranks, devices=[r % 4 for r in range(ranks)], hosts=[f"b{r // 4}" for r in range(ranks)])
    numel = (mib << 20) // 4
    for r in g.ranks:
        r.ensure_arena(numel * 4)
    times = []
    for it in range(1, iters + 1):
        for i, r in enumerate(g.ranks):
            r.arena.bytes_view(0, numel * 4).view(np.float32)[:] = i + it
        t = time.monotonic()
        for r in g.ranks:
            r.post(s.CollOp.ALLREDUCE, numel, out_numel=numel, in_off=0, out_off=0)
        for r in g.ranks:
            rep = r.client.recv(timeout_s=600)
            assert isinstance(rep, s.Done) and rep.seq == it, rep
        times.append(time.monotonic() - t)
        want = float(sum(range(ranks)) + ranks * it)
        for r in g.ranks:
            v = r.arena.bytes_view(0, numel * 4).view(np.float32)
            assert v[0] == want and v[-1] == want and (v[:: 1 << 16] == want).all()
    out["big_s"] = times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--small", type=int, default=3000, help="small all-reduces per rank")
    p.add_argument("--window", type=int, default=4, help="small all-reduces in flight per rank")
    p.add_argument("--big-ranks", type=int, default=8)
    p.add_argument("--big-mib", type=int, default=256)
    p.add_argument("--big-iters", type=int, default=3)
    a = p.parse_args()
    d = DaemonProcess()
    daemon = psutil.Process(d.proc.pid)
    rss = [daemon.memory_info().rss]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            try:
                rss.append(daemon.memory_info().rss)
            except psutil.Error:
                return

    results: dict = {}
    errors: list[BaseException] = []

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=sample)]
    if a.big_iters:
        threads.append(threading.Thread(target=guarded, args=(run_big, d, a.big_ranks, a.big_mib, a.big_iters, results)))
    try:
        for t in threads:
            t.start()
        start = time.monotonic()
        guarded(run_small, d, a.ranks, a.small, a.window, results)
        for t in threads[1:]:
            t.join()
        wall = time.monotonic() - start
        cpu = daemon.cpu_times()
        uss = daemon.memory_full_info().uss  # private memory: RSS also counts the ranks' mapped arenas
        stop.set()
        threads[0].join()
        alive = d.alive()
    finally:
        stop.set()
        d.stop()
    if errors:
        raise errors[0]
    print(f"small: {a.ranks} ranks x {a.small} all-reduces of {SMALL * 4} B (window {a.window}): "
          f"{results['small_completions']} completions in order and exact, {results['barriers']} sub-communicator "
          f"barriers, {results['small_s']:.1f} s ({a.small / results['small_s']:.0f} collectives/s)")
    if a.big_iters:
        print(f"big: {a.big_ranks} ranks x {a.big_mib} MiB all-reduce x {a.big_iters}: "
              + ", ".join(f"{t:.2f} s" for t in results["big_s"]) + " each, exact")
    print(f"daemon: RSS {rss[0] / 2**20:.0f} MiB at start, peak {max(rss) / 2**20:.0f} MiB, "
          f"{rss[-1] / 2**20:.0f} MiB at the end (of which private: {uss / 2**20:.0f} MiB; the rest is the "
          f"ranks' shared-memory arenas it maps); cpu {cpu.user + cpu.system:.1f} s over {wall:.1f} s wall; "
          f"alive after: {alive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
