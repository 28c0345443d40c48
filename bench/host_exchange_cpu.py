"""What a collective across hosts costs its host daemons in CPU, away from the box's load.

    python bench/host_exchange_cpu.py [--hosts 2] [--mib 32] [--links] [--op broadcast ...]

Runs every host's :class:`emulator.host_exchange.Exchange` in this process (one
rank per host, float32) and prints the CPU seconds (``time.process_time``, every
thread of the process; median of 7 after one warm-up) all hosts together spend
per all-reduce, all-gather, reduce-scatter and broadcast (``--op`` picks some;
a broadcast's root is rank 0, on host 0). Beside it, what host 0 alone sent
(MiB, counted at its ``send``) and spent (``time.thread_time`` in its
exchange's calls: its copies, and with ``--links`` its sealing; not ZeroMQ's
threads): a broadcast's root's host, which sends the most where it sends
every other host the buffer itself. By default each chunk is handed
straight to the host it is for: the reductions and copies of the exchange, none
of the sealing or TCP. With ``--links`` each host has its real
:class:`emulator.peer_links.PeerLinks` on 127.0.0.1, so the figure is the whole
host-daemon path but the daemons' loop: sealing, ZeroMQ, TCP both ways, opening;
it also prints the CPU per MiB each host sent, which stays flat as hosts are
added where the exchange scales as a ring does. Figures only: nothing here
asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from emulator import host_exchange  # noqa: E402
from emulator.exchange_kinds import Layout, Share  # noqa: E402
from emulator.host_exchange import Exchange  # noqa: E402
from emulator.ledger import Posted  # noqa: E402
from emulator.peer_links import PeerLinks  # noqa: E402
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


OPS = [CollOp.ALLREDUCE, CollOp.ALLGATHER, CollOp.REDUCE_SCATTER, CollOp.BROADCAST]


def exchanges_of(op: CollOp, hosts: int, numel: int, seq: int = 1) -> list[Exchange]:
    """Every host's exchange of one collective of ``numel`` float32 elements in all (its whole buffer)."""
    n, out_n = {CollOp.ALLREDUCE: (numel, numel), CollOp.ALLGATHER: (numel // hosts, numel),
                CollOp.REDUCE_SCATTER: (numel, numel // hosts), CollOp.BROADCAST: (numel, numel)}[op]
    exchanges = []
    for h in range(hosts):
        req = Collective(comm="c", seq=seq, rank=0, op=op, reduce_op=ReduceOp.SUM, dtype="float32", numel=n,
                         out_numel=out_n, root=0)
        inp = np.ones(n, np.float32)
        out = inp if op in (CollOp.ALLREDUCE, CollOp.BROADCAST) else np.empty(out_n, np.float32)
        layout = Layout([f"h{j}" for j in range(hosts)], list(range(hosts)), h)
        exchanges.append(Exchange(Share(req, [Posted(b"r", req)], [inp], [out]), layout))
    return exchanges


class Host0:
    """What host 0 sent (bytes) and spent (CPU seconds of this thread in its exchange's calls), summed."""

    def __init__(self):
        self.sent = 0
        self.cpu = 0.0

    def counted(self, send):
        """``send`` for host 0, its bytes counted."""
        def count(j, msg, data):
            self.sent += data.nbytes
            send(j, msg, data)
        return count

    def call(self, h: int, method, *args) -> None:
        """``method(*args)`` of host ``h``'s exchange, timed if it is host 0's."""
        t = time.thread_time() if h == 0 else 0.0
        method(*args)
        if h == 0:
            self.cpu += time.thread_time() - t


def once(op: CollOp, hosts: int, numel: int, host0: Host0) -> None:
    """One collective, every host's share run here, each chunk handed straight to the host it is for."""
    exchanges = exchanges_of(op, hosts, numel)
    queue: list[tuple[int, int, p.PeerChunk, Frame]] = []

    def sender(src: int):
        return lambda j, msg, data: queue.append((j, src, msg, Frame(data)))

    sends = [host0.counted(sender(0))] + [sender(h) for h in range(1, hosts)]
    while queue or any(ex.busy for ex in exchanges):
        for h, ex in enumerate(exchanges):
            if ex.busy:
                host0.call(h, ex.advance, sends[h])
        while queue:
            j, src, msg, frame = queue.pop(0)
            host0.call(j, exchanges[j].take, src, msg, frame, sends[j])
    assert all(ex.finished for ex in exchanges)


class Linked:
    """Every host's peer links on 127.0.0.1, sealed with one run key, as the host daemons of a run have them."""

    def __init__(self, hosts: int):
        self.ctx = zmq.Context(io_threads=2)  # as a daemon's
        self.links = [PeerLinks(self.ctx, f"h{j}", "token", "127.0.0.1") for j in range(hosts)]
        directory = {x.host: [x.endpoint, x.cipher.name] for x in self.links}
        for x in self.links:
            x.link(directory, bytes(range(32)))
        self.poller = zmq.Poller()
        for x in self.links:
            self.poller.register(x.router, zmq.POLLIN)
        self.seq = 0

    def once(self, op: CollOp, numel: int, host0: Host0) -> None:
        """One collective, every host's share run here, its chunks sealed and sent over its links."""
        self.seq += 1
        exchanges = exchanges_of(op, len(self.links), numel, self.seq)
        sends = [lambda j, msg, data, h=h: self.links[h].send(f"h{j}", msg, data) for h in range(len(self.links))]
        sends[0] = host0.counted(sends[0])
        while not all(ex.finished for ex in exchanges):
            for h, ex in enumerate(exchanges):
                if ex.busy:
                    host0.call(h, ex.advance, sends[h])
            ready = dict(self.poller.poll(0 if any(ex.busy for ex in exchanges) else 1000))
            for h, x in enumerate(self.links):
                if x.router in ready:
                    for msg, data in x.receive():
                        if isinstance(msg, p.PeerChunk):
                            host0.call(h, exchanges[h].take, int(msg.host[1:]), msg, data, sends[h])

    def sent(self) -> int:
        """Data bytes all hosts sent so far (sealed chunks, less their tags)."""
        return sum(x.sent_bytes for x in self.links)

    def close(self) -> None:
        """Close every link and the ZeroMQ context."""
        for x in self.links:
            x.close()
        self.ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--mib", type=int, default=32, help="the collective's whole buffer, MiB (default 32)")
    ap.add_argument("--links", action="store_true", help="over real peer links (sealed, TCP on 127.0.0.1)")
    ap.add_argument("--op", action="append", type=CollOp, choices=OPS, metavar="OP",
                    help="a collective to time, again for more (default: all of " +
                         ", ".join(op.value for op in OPS) + ")")
    a = ap.parse_args()
    if a.hosts < 2:
        ap.error("--hosts must be at least 2")
    numel = (a.mib << 20) // 4
    linked = Linked(a.hosts) if a.links else None
    how = "over sealed peer links (TCP on 127.0.0.1)" if linked else "chunks handed over in process"
    print(f"{a.hosts} hosts, {a.mib} MiB float32, one rank per host, {how}, chunks of "
          f"{host_exchange.CHUNK_BYTES >> 10} KiB: CPU ms of all hosts per collective")
    try:
        for op in a.op or OPS:
            run = (lambda h: linked.once(op, numel, h)) if linked else (lambda h: once(op, a.hosts, numel, h))
            run(Host0())
            times, sent, host0 = [], linked.sent() if linked else 0, []
            for _ in range(7):
                host0.append(Host0())
                t = time.process_time()
                run(host0[-1])
                times.append(time.process_time() - t)
            line = (f"{op.value:<15} {statistics.median(times) * 1e3:8.1f} ms (min {min(times) * 1e3:.1f}); host 0 "
                    f"sent {host0[0].sent / (1 << 20):5.1f} MiB, "
                    f"{statistics.median(h.cpu for h in host0) * 1e3:6.1f} ms")
            if linked:  # each host's share of the CPU, per MiB it sent
                per_host_mib = (linked.sent() - sent) / 7 / a.hosts / (1 << 20)
                line += (f"   {per_host_mib:5.1f} MiB sent per host, "
                         f"{statistics.median(times) * 1e3 / a.hosts / per_host_mib:.2f} ms per MiB per host")
            print(line)
    finally:
        if linked:
            linked.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
