"""Collectives across hosts, in process: every host's share of the plan, its chunks passed by hand.

Each "host" is an :class:`emulator.host_exchange.Exchange` over numpy buffers
(its ranks' inputs and outputs); what one sends to another is queued and
handed over in a shuffled order, as links of different speeds would deliver
it. Tiny chunks make a few KiB behave like many MiB. Every result is compared,
byte for byte, with what the head's daemon computes for the same collective
(the wave scheduler's kernel over every rank's data frames).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from emulator import host_exchange
from emulator.exchange_kinds import Layout, Share
from emulator.host_exchange import Exchange, ExchangeError
from emulator.ledger import Communicator, Posted
from emulator.scheduler import make_job
from wire import kernels
from wire import peers as p
from wire.schema import Collective, CollOp, ReduceOp, Transport


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


def _request(op, red, dtype, numel, out_numel, root, rank, transport=Transport.SHM) -> Collective:
    return Collective(comm="c", seq=3, rank=rank, op=op, reduce_op=red, dtype=dtype, numel=numel,
                      out_numel=out_numel, root=root, transport=transport)


def _head(op, red, dtype, numel, out_numel, root, inputs) -> list[np.ndarray]:
    """Every rank's output as the head's daemon computes it: the wave scheduler's kernel over data frames."""
    world = len(inputs)
    posted = [Posted(b"r%d" % r, _request(op, red, dtype, numel, out_numel, root, r, Transport.SOCKET))
              for r in range(world)]
    frames = {id(q): (inputs[r] if op is not CollOp.BROADCAST or r == root else inputs[r][:0]).view(np.uint8)
              for r, q in enumerate(posted)}
    job = make_job(Communicator("c", world), posted, lambda name: None, lambda q: frames[id(q)])
    job.run_range(job, 0, job.total)
    return job.outputs


def _shares(op, red, dtype, numel, out_numel, root, inputs, host_of) -> list[Exchange]:
    """Each host's exchange, its ranks' outputs as a rank's shared memory holds them (in place where it may)."""
    hosts = sorted(set(host_of))
    exchanges = []
    for h in hosts:
        layout = Layout([f"h{j}" for j in hosts], list(host_of), h)
        mine = layout.mine
        posted = [Posted(b"r%d" % r, _request(op, red, dtype, numel, out_numel, root, i)) for i, r in enumerate(mine)]
        ins = [inputs[r].copy() for r in mine]
        if op in (CollOp.ALLREDUCE, CollOp.BROADCAST):
            outs = [ins[0]] + [np.zeros_like(x) for x in ins[1:]]  # the first in place, as in its arena
        else:
            outs = [np.zeros(out_numel, ins[0].dtype) for _ in mine]
        exchanges.append(Exchange(Share(posted[0].request, posted, ins, outs), layout))
    return exchanges


def _run(exchanges: list[Exchange], seed: int) -> list[tuple[int, int, p.PeerChunk]]:
    """Pass chunks between the exchanges, in a shuffled order, until none is left; what was sent, as (from host,
    to host, chunk)."""
    rng = random.Random(seed)
    queue: list[tuple[int, p.PeerChunk, Frame]] = []
    sent: list[tuple[int, int, p.PeerChunk]] = []

    def sender(src: int):
        def send(j: int, msg: p.PeerChunk, data: np.ndarray):
            sent.append((src, j, msg))
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
    return sent


def _values(rng, dtype: str, shape, integral: bool) -> np.ndarray:
    """Inputs in the dtype's storage: small integers (sums every order rounds alike) or random floats."""
    if integral or kernels.DTYPES[dtype].kind in "iub":
        values = rng.integers(-10, 10, size=shape).astype(np.float64)
    else:
        values = rng.standard_normal(shape) * 100
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(kernels.DTYPES[dtype])


def _check(op, red, dtype, numel, out_numel, root, host_of, integral=True, seed=0):
    """Run the collective across hosts; every rank's output must equal the head's. Returns what was sent."""
    rng = np.random.default_rng(seed)
    world = len(host_of)
    inputs = list(_values(rng, dtype, (world, numel), integral))
    want = _head(op, red, dtype, numel, out_numel, root, inputs)
    exchanges = _shares(op, red, dtype, numel, out_numel, root, inputs, host_of)
    sent = _run(exchanges, seed=numel + world)
    for ex in exchanges:
        for r, out in zip(ex.layout.mine, ex.share.outputs):
            assert out.tobytes() == want[r].tobytes(), f"rank {r} on host {ex.me}"
    return sent


#: where the ranks run: two hosts in blocks, interleaved, three hosts unevenly, four with one rank each
LAYOUTS = [(0, 1), (0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 1, 2, 2, 2), (0, 1, 2, 3)]
DTYPES = ["float32", "bfloat16", "float16", "int64"]


@pytest.fixture(autouse=True)
def tiny_chunks(monkeypatch):
    monkeypatch.setattr(host_exchange, "CHUNK_BYTES", 64)  # many chunks per piece
    monkeypatch.setattr(host_exchange, "TURN_BYTES", 200)  # several turns of local work


@pytest.mark.parametrize("host_of", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("red", [ReduceOp.SUM, ReduceOp.AVG])
@pytest.mark.parametrize("numel", [999, 2])
def test_an_all_reduce_equals_the_head_s(host_of, dtype, red, numel):
    _check(CollOp.ALLREDUCE, red, dtype, numel, numel, 0, host_of)


@pytest.mark.parametrize("host_of", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("red", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX])
@pytest.mark.parametrize("share", [1, 37, 257])
def test_a_reduce_scatter_equals_the_head_s(host_of, dtype, red, share):
    world = len(host_of)
    _check(CollOp.REDUCE_SCATTER, red, dtype, share * world, share, 0, host_of)


@pytest.mark.parametrize("host_of", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES + ["bool", "int8"])
@pytest.mark.parametrize("numel", [1, 37, 301])
def test_an_all_gather_equals_the_head_s(host_of, dtype, numel):
    _check(CollOp.ALLGATHER, ReduceOp.SUM, dtype, numel, numel * len(host_of), 0, host_of, integral=False)


@pytest.mark.parametrize("host_of", LAYOUTS + [(0, 1, 2, 3, 2, 1, 0), (0, 1, 2, 3, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 1001])
def test_a_broadcast_equals_the_head_s_from_every_root(host_of, dtype, numel):
    for root in range(len(host_of)):
        _check(CollOp.BROADCAST, ReduceOp.SUM, dtype, numel, numel, root, host_of, integral=False, seed=root)


@pytest.mark.parametrize("hosts", [2, 3, 4, 5])
def test_a_broadcast_passes_each_chunk_along_the_chain_from_the_root_s_host_once(hosts):
    """As RCCL's ring: the root's host sends each chunk to the next host only, each host after it forwards
    it to the next, the last to none; so the root's host sends the buffer once, not H - 1 times."""
    host_of = tuple(range(hosts)) + (hosts - 1, 0)  # two hosts with two ranks, the root's among them
    numel = 1001  # 63 chunks of 16 float32 (CHUNK_BYTES 64), the last of 9
    for root in range(len(host_of)):
        sent = _check(CollOp.BROADCAST, ReduceOp.SUM, "float32", numel, numel, root, host_of, seed=root)
        chain = [(host_of[root] + k) % hosts for k in range(hosts)]  # the layout's order from the root's host
        for pos, h in enumerate(chain):
            mine = [(j, msg) for i, j, msg in sent if i == h]
            assert {j for j, _ in mine} == set(chain[pos + 1:pos + 2]), f"host {h}, root {root}"
            assert sorted(msg.at for _, msg in mine) == ([] if pos == hosts - 1 else list(range(0, numel, 16)))
            assert sum(msg.count for _, msg in mine) == (0 if pos == hosts - 1 else numel)
            assert all(msg.phase is p.PeerPhase.RESULT for _, msg in mine)


@pytest.mark.parametrize("op", [CollOp.ALLREDUCE, CollOp.REDUCE_SCATTER])
@pytest.mark.parametrize("red", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.PRODUCT])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_random_floats_with_one_rank_per_host_reduce_in_the_head_s_order(op, red, dtype):
    """The owner reduces the hosts' partials in host order: with one rank per host, rank by rank as the head."""
    host_of = (0, 1, 2)
    _check(op, red, dtype, 3 * 211, 211 if op is CollOp.REDUCE_SCATTER else 3 * 211, 0, host_of, integral=False)


def test_an_integer_average_truncates_toward_zero_as_nccl():
    """-7 / 4 is -1 on the GPU (C's division), not -2 (floor): summed on every host, divided once."""
    inputs = [np.array([-7, 7, -8, 5], np.int32), np.array([0, 0, 0, 0], np.int32),
              np.array([0, 0, 0, 1], np.int32), np.array([0, 0, 0, 1], np.int32)]
    exchanges = _shares(CollOp.ALLREDUCE, ReduceOp.AVG, "int32", 4, 4, 0, inputs, (0, 0, 1, 1))
    _run(exchanges, seed=1)
    for ex in exchanges:
        for out in ex.share.outputs:
            np.testing.assert_array_equal(out, [-1, 1, -2, 1])


def test_a_chunk_of_another_collective_or_off_the_plan_is_refused():
    x = [np.zeros(100, np.float32)] * 2
    ex = _shares(CollOp.ALLREDUCE, ReduceOp.SUM, "float32", 100, 100, 0, x, (0, 1))[0]
    other = p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.PARTIAL, dtype="float64", numel=100, at=0, count=50)
    with pytest.raises(ExchangeError, match="float64"):
        ex.take(1, other, Frame(np.zeros(50, np.float64)), lambda *a: None)
    skewed = p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.PARTIAL, numel=100, at=1, count=15)
    with pytest.raises(ExchangeError, match="not a chunk of its plan"):
        ex.take(1, skewed, Frame(np.zeros(15, np.float32)), lambda *a: None)
    # a result for a segment the sender does not own
    stolen = p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.RESULT, numel=100, at=0, count=16)
    with pytest.raises(ExchangeError, match="not a chunk of its plan"):
        ex.take(1, stolen, Frame(np.zeros(16, np.float32)), lambda *a: None)


@pytest.mark.parametrize("op,phase", [(CollOp.ALLGATHER, p.PeerPhase.PARTIAL),
                                      (CollOp.REDUCE_SCATTER, p.PeerPhase.RESULT)])
def test_a_phase_its_kind_does_not_send_is_refused(op, phase):
    """An all-gather has no partials to reduce; a reduce-scatter's owner sends no result on."""
    x = [np.zeros(32, np.float32)] * 2
    out_numel = 64 if op is CollOp.ALLGATHER else 16
    ex = _shares(op, ReduceOp.SUM, "float32", 32, out_numel, 0, x, (0, 1))[0]
    at = 32 if op is CollOp.ALLGATHER else 0  # host 1's piece, or host 0's own
    msg = p.PeerChunk(comm="c", seq=3, phase=phase, op=op, numel=32, at=at, count=16)
    with pytest.raises(ExchangeError, match="not a chunk of its plan"):
        ex.take(1, msg, Frame(np.zeros(16, np.float32)), lambda *a: None)


def test_it_waits_on_the_hosts_whose_chunks_are_missing():
    x = [np.ones(30, np.float32)] * 3
    exchanges = _shares(CollOp.ALLREDUCE, ReduceOp.SUM, "float32", 30, 30, 0, x, (0, 1, 2))
    assert exchanges[0].waiting_on() == {1, 2}
    exchanges[0].advance(lambda *a: None)
    assert exchanges[0].waiting_on() == {1, 2} and not exchanges[0].finished
    # a broadcast from host 0 waits on nobody there, and on the host before it in the chain 0 -> 1 -> 2 elsewhere
    bcast = _shares(CollOp.BROADCAST, ReduceOp.SUM, "float32", 30, 30, 0, x, (0, 1, 2))
    assert bcast[0].waiting_on() == set() and bcast[1].waiting_on() == {0} and bcast[2].waiting_on() == {1}


def _broadcast_from_host_1_of_4() -> list[Exchange]:
    """A broadcast of 32 float32 (two chunks) from rank 1, on host 1 of 4: the chain is 1 -> 2 -> 3 -> 0."""
    x = [np.arange(32, dtype=np.float32)] * 4
    return _shares(CollOp.BROADCAST, ReduceOp.SUM, "float32", 32, 32, 1, x, (0, 1, 2, 3))


def _result(at: int) -> p.PeerChunk:
    return p.PeerChunk(comm="c", seq=3, phase=p.PeerPhase.RESULT, op=CollOp.BROADCAST, numel=32, at=at, count=16)


def test_a_broadcast_waits_on_the_host_before_it_in_the_chain():
    """The chain starts at the root's host and wraps round: a hang names the host that did not forward."""
    bcast = _broadcast_from_host_1_of_4()
    assert [ex.waiting_on() for ex in bcast] == [{3}, set(), {1}, {2}]
    bcast[1].advance(lambda *a: None)
    assert bcast[1].finished and bcast[1].waiting_on() == set()
    forwarded = []
    for at in (0, 16):
        bcast[2].take(1, _result(at), Frame(np.zeros(16, np.float32)), lambda *a: forwarded.append(a[:2]))
        assert bcast[2].finished == (at == 16)
    assert bcast[2].waiting_on() == set() and [(j, msg.at) for j, msg in forwarded] == [(3, 0), (3, 16)]


def test_a_broadcast_chunk_from_a_host_but_the_one_before_or_twice_is_refused():
    bcast = _broadcast_from_host_1_of_4()
    nothing = lambda *a: pytest.fail("a refused chunk was forwarded")  # noqa: E731
    # the root's host sends to host 2 only: host 3 takes its chunks from host 2, host 0 from host 3
    for ex, j in [(bcast[3], 1), (bcast[3], 0), (bcast[0], 1), (bcast[0], 2), (bcast[1], 0)]:
        with pytest.raises(ExchangeError, match="not a chunk of its plan"):
            ex.take(j, _result(0), Frame(np.zeros(16, np.float32)), nothing)
    bcast[3].take(2, _result(0), Frame(np.zeros(16, np.float32)), lambda *a: None)
    with pytest.raises(ExchangeError, match="twice"):
        bcast[3].take(2, _result(0), Frame(np.zeros(16, np.float32)), nothing)
    assert bcast[3].waiting_on() == {2} and not bcast[3].finished
