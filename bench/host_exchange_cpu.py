"""What a collective across hosts costs its host daemons in CPU, away from links, ciphers and the box's load.

    python bench/host_exchange_cpu.py [--hosts 2] [--mib 32]

Runs every host's :class:`emulator.host_exchange.Exchange` in this process (one
rank per host, float32), handing each chunk straight to the host it is for, and
prints the CPU seconds (``time.process_time``, median of 7 after one warm-up)
all hosts together spend per all-reduce, all-gather and reduce-scatter: the
reductions and copies of the exchange, none of the sealing or TCP that
``bench/host_paths.py`` also times. Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from emulator.exchange_kinds import Layout, Share  # noqa: E402
from emulator.host_exchange import Exchange  # noqa: E402
from emulator.ledger import Posted  # noqa: E402
from wire import peers as p  # noqa: E402
from wire.schema import Collective, CollOp, ReduceOp  # noqa: E402


class Frame:
    """A chunk as a link hands it over (as ``emulator.peer_seal.Sealed``): bytes opened where they go."""

    def __init__(self, data: np.ndarray):
        self.bytes = data.view(np.uint8).copy()
        self.nbytes = self.bytes.nbytes

    def open(self, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self.bytes
        out[...] = self.bytes
        return out


def once(op: CollOp, hosts: int, numel: int) -> None:
    """One collective of ``numel`` float32 elements in all (its whole buffer), every host's share run here."""
    n, out_n = {CollOp.ALLREDUCE: (numel, numel), CollOp.ALLGATHER: (numel // hosts, numel),
                CollOp.REDUCE_SCATTER: (numel, numel // hosts)}[op]
    exchanges = []
    for h in range(hosts):
        req = Collective(comm="c", seq=1, rank=0, op=op, reduce_op=ReduceOp.SUM, dtype="float32", numel=n,
                         out_numel=out_n)
        inp = np.ones(n, np.float32)
        out = inp if op is CollOp.ALLREDUCE else np.empty(out_n, np.float32)
        layout = Layout([f"h{j}" for j in range(hosts)], list(range(hosts)), h)
        exchanges.append(Exchange(Share(req, [Posted(b"r", req)], [inp], [out]), layout))
    queue: list[tuple[int, int, p.PeerChunk, Frame]] = []

    def sender(src: int):
        return lambda j, msg, data: queue.append((j, src, msg, Frame(data)))

    sends = [sender(h) for h in range(hosts)]
    while queue or any(ex.busy for ex in exchanges):
        for h, ex in enumerate(exchanges):
            if ex.busy:
                ex.advance(sends[h])
        while queue:
            j, src, msg, frame = queue.pop(0)
            exchanges[j].take(src, msg, frame, sends[j])
    assert all(ex.finished for ex in exchanges)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--mib", type=int, default=32, help="the collective's whole buffer, MiB (default 32)")
    a = ap.parse_args()
    numel = (a.mib << 20) // 4
    print(f"{a.hosts} hosts, {a.mib} MiB float32, one rank per host: CPU ms of all hosts per collective")
    for op in (CollOp.ALLREDUCE, CollOp.ALLGATHER, CollOp.REDUCE_SCATTER):
        once(op, a.hosts, numel)
        times = []
        for _ in range(7):
            t = time.process_time()
            once(op, a.hosts, numel)
            times.append(time.process_time() - t)
        print(f"{op.value:<15} {statistics.median(times) * 1e3:8.1f} ms (min {min(times) * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
