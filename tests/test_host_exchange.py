"""An all-reduce across hosts, in process: every host's share of the plan, its chunks passed by hand.

Each "host" is an :class:`emulator.host_exchange.Exchange` over numpy buffers
(its ranks' inputs, the first rank's output as its result); what one sends to
another is queued and handed over in a shuffled order, as links of different
speeds would deliver it. Tiny chunks make a few KiB behave like many MiB.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from emulator import host_exchange
from emulator.host_exchange import Exchange, ExchangeError, segments
from emulator.ledger import Communicator, Posted
from emulator.scheduler import Job
from wire import kernels
from wire import peers as p
from wire.schema import Collective, CollOp, ReduceOp


class Frame:
    """What a link hands over: the bytes, opened where they go (as ``emulator.peer_seal.Sealed``)."""

    def __init__(self, data: np.ndarray):
        self.bytes = np.frombuffer(data.tobytes(), np.uint8)
        self.nbytes = self.bytes.nbytes

    def open(self, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self.bytes.copy()
        out[...] = self.bytes
        return out


def _exchange(hosts: int, me: int, inputs: list[np.ndarray], dtype: str, op: ReduceOp, seq: int = 3) -> Exchange:
    n = len(inputs[0])
    posted = [Posted(b"r%d" % r, Collective(comm="c", seq=seq, rank=r, op=CollOp.ALLREDUCE, reduce_op=op, dtype=dtype,
                                           numel=n, out_numel=n)) for r in range(len(inputs))]
    outputs = [inputs[0]] + [np.zeros_like(x) for x in inputs[1:]]  # the first rank in place, as in its arena
    job = Job(Communicator("c", len(inputs)), posted, inputs, outputs, n, kernels.itemsize(dtype), lambda *a: None)
    return Exchange(job, [f"h{j}" for j in range(hosts)], me)


def _run(exchanges: list[Exchange], seed: int) -> None:
    """Pass chunks between the exchanges, in a shuffled order, until none is left."""
    rng = random.Random(seed)
    queue: list[tuple[int, p.PeerChunk, Frame]] = []

    def sender(src: int):
        def send(j: int, msg: p.PeerChunk, data: np.ndarray):
            queue.append((j, p.PeerChunk(**{**msg.__dict__, "host": f"h{src}"}), Frame(data)))
        return send

    sends = [sender(i) for i in range(len(exchanges))]
    while queue or any(ex.busy for ex in exchanges):
        for i, ex in enumerate(exchanges):
            if ex.busy and rng.random() < 0.5:
                ex.advance(sends[i])
        if queue:
            j, msg, frame = queue.pop(rng.randrange(len(queue)))
            exchanges[j].take(int(msg.host[1:]), msg, frame, sends[j])
    for ex in exchanges:
        assert ex.finished
        ex.deliver()


@pytest.mark.parametrize("hosts,ranks,numel", [(2, 1, 1000), (2, 2, 999), (3, 1, 1001), (4, 3, 517), (3, 2, 2)])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_every_rank_of_every_host_gets_the_reduction(monkeypatch, hosts, ranks, numel, dtype):
    monkeypatch.setattr(host_exchange, "CHUNK_BYTES", 64)  # many chunks per segment
    monkeypatch.setattr(host_exchange, "TURN_BYTES", 200)  # several turns of local work
    rng = np.random.default_rng(hosts * 100 + ranks)
    bound = 10 if dtype == "bfloat16" else 50  # small integers, and sums bfloat16 holds exactly (up to 256)
    values = rng.integers(-bound, bound, size=(hosts, ranks, numel))
    storage = kernels.DTYPES[dtype]
    if dtype == "bfloat16":
        as_bits = lambda v: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
        inputs = [[as_bits(values[h, r]) for r in range(ranks)] for h in range(hosts)]
    else:
        inputs = [[values[h, r].astype(storage) for r in range(ranks)] for h in range(hosts)]
    exchanges = [_exchange(hosts, h, inputs[h], dtype, ReduceOp.SUM) for h in range(hosts)]
    _run(exchanges, seed=numel)
    want = values.sum(axis=(0, 1))
    for ex in exchanges:
        for out in ex.job.targets:
            got = (out.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else out
            np.testing.assert_array_equal(got, want)


def test_max_across_three_hosts():
    values = [np.array([1.0, 9.0, -3.0, 4.0], np.float32), np.array([2.0, 0.0, -1.0, 8.0], np.float32),
              np.array([0.5, 5.0, -7.0, 1.0], np.float32)]
    exchanges = [_exchange(3, h, [values[h].copy()], "float32", ReduceOp.MAX) for h in range(3)]
    _run(exchanges, seed=1)
    for ex in exchanges:
        np.testing.assert_array_equal(ex.out, np.max(values, axis=0))


def test_a_chunk_of_another_collective_or_off_the_plan_is_refused():
    ex = _exchange(2, 0, [np.zeros(100, np.float32)], "float32", ReduceOp.SUM)
    lo, hi = segments(100, 2)[0]
    other = p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.PARTIAL, dtype="float64", numel=100, at=lo, count=hi - lo)
    with pytest.raises(ExchangeError, match="float64"):
        ex.take(1, other, Frame(np.zeros(hi - lo, np.float64)), lambda *a: None)
    skewed = p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.PARTIAL, numel=100, at=lo + 1, count=hi - lo - 1)
    with pytest.raises(ExchangeError, match="not a chunk of its plan"):
        ex.take(1, skewed, Frame(np.zeros(hi - lo - 1, np.float32)), lambda *a: None)
    # a result for a segment the sender does not own
    stolen = p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.REDUCED, numel=100, at=lo, count=hi - lo)
    with pytest.raises(ExchangeError, match="not a chunk of its plan"):
        ex.take(1, stolen, Frame(np.zeros(hi - lo, np.float32)), lambda *a: None)


def test_it_waits_on_the_hosts_whose_chunks_are_missing():
    exchanges = [_exchange(3, h, [np.ones(30, np.float32)], "float32", ReduceOp.SUM) for h in range(3)]
    assert exchanges[0].waiting_on() == {1, 2}
    exchanges[0].advance(lambda *a: None)
    assert exchanges[0].waiting_on() == {1, 2} and not exchanges[0].finished
