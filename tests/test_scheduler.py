"""The wave scheduler, in process: chunking, round-robin fairness, progress, results.

Jobs are built with ``make_job`` from hand-made ``Posted`` collectives over
real /dev/shm arenas (unlinked after each test); tiny chunk and wave sizes make
a few KiB behave like gigabytes.
"""

from __future__ import annotations

import secrets
import uuid

import numpy as np
import pytest
from daemon_client import bf16_bits, bf16_to_f32

from emulator.ledger import Communicator, Posted
from emulator.scheduler import CHUNK_BYTES, WAVE_BYTES, Job, WaveScheduler, make_job
from wire.arena import Arena, ArenaError, arena_name
from wire.kernels import KernelError
from wire.schema import Collective, CollOp, CommInit, ReduceOp

C = CollOp


class Fixture:
    """Arenas of one fake session, and builders for matched collectives."""

    def __init__(self):
        self.session = secrets.token_hex(4)
        self.arenas: dict[str, Arena] = {}

    def arena(self, tag: str, nbytes: int) -> Arena:
        a = Arena.create(arena_name(self.session, tag), max(nbytes, 1))
        self.arenas[a.name] = a
        return a

    def arena_of(self, name: str) -> Arena:
        return self.arenas[name]

    def job(
        self,
        op: CollOp,
        inputs: list[np.ndarray],
        dtype: str = "float32",
        reduce_op: ReduceOp = ReduceOp.SUM,
        root: int = 0,
        out_numel: int | None = None,
        in_place: bool = True,
    ) -> tuple[Job, list[tuple[Arena, int]]]:
        """A job over fresh arenas holding ``inputs``; returns it and each rank's (arena, out_off)."""
        world = len(inputs)
        comm = Communicator(uuid.uuid4().hex, world)
        numel = inputs[0].size
        if out_numel is None:
            out_numel = {C.ALLGATHER: numel * world, C.REDUCE_SCATTER: numel // world, C.BARRIER: 0}.get(op, numel)
        esize = inputs[0].dtype.itemsize
        same = in_place and out_numel == numel
        out_off = 0 if same else (numel * esize + 63) // 64 * 64
        posted, where = [], []
        for r, x in enumerate(inputs):
            comm.members[r] = CommInit(comm=comm.comm, rank=r, size=world, global_rank=r)
            a = self.arena(f"{comm.comm[:8]}-r{r}", max(numel * esize, out_off + out_numel * esize))
            a.bytes_view(0, x.nbytes)[:] = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
            req = Collective(
                comm=comm.comm, seq=1, rank=r, op=op, reduce_op=reduce_op, dtype=dtype, numel=numel,
                out_numel=out_numel, root=root, device=r, arena=a.name, in_off=0, out_off=out_off,
            )
            posted.append(Posted(client=f"c{r}".encode(), request=req))
            where.append((a, out_off))
        return make_job(comm, posted, self.arena_of), where

    def close(self):
        for a in self.arenas.values():
            a.close()
            a.unlink()


@pytest.fixture
def fx():
    f = Fixture()
    try:
        yield f
    finally:
        f.close()


def read(where, numel, np_dtype):
    a, off = where
    return a.bytes_view(off, numel * np.dtype(np_dtype).itemsize).view(np_dtype).copy()


def drain(sched: WaveScheduler, limit: int = 10_000) -> list[tuple[list[Job], list[Job]]]:
    waves = []
    while sched.busy:
        waves.append(sched.run_wave())
        assert len(waves) < limit, "scheduler does not make progress"
    return waves


def test_defaults_are_nccl_sized():
    sched = WaveScheduler()
    assert (sched.chunk_bytes, sched.wave_bytes) == (CHUNK_BYTES, WAVE_BYTES) == (512 << 10, 16 << 20)
    assert not sched.busy
    assert sched.run_wave() == ([], [])


def test_tiny_job_is_not_starved_by_a_big_one(fx):
    sched = WaveScheduler(chunk_bytes=1024, wave_bytes=4096)
    n = 64 * 1024  # 256 KiB of float32: 64 waves of 4 KiB
    big_in = [np.arange(n, dtype=np.float32), np.ones(n, np.float32)]
    big, big_out = fx.job(C.ALLREDUCE, big_in)
    tiny, tiny_out = fx.job(C.ALLREDUCE, [np.full(4, 2.0, np.float32), np.full(4, 5.0, np.float32)])
    sched.submit(big)
    sched.submit(tiny)
    progressed, finished = sched.run_wave()
    assert finished == [tiny]
    assert tiny in progressed and big in progressed
    for w in tiny_out:
        np.testing.assert_array_equal(read(w, 4, np.float32), np.full(4, 7.0, np.float32))
    # the big one got a wave's worth (the budget may be overrun by at most one chunk)
    assert 0 < big.done < big.total
    assert 4096 - 16 <= big.done * 4 < 4096 + 1024
    # its progress accumulates wave by wave until it completes
    seen = [big.done]
    while sched.busy:
        progressed, finished = sched.run_wave()
        assert progressed == [big]
        assert big.done > seen[-1]
        assert big.done * 4 - seen[-1] * 4 <= 4096 + 1024
        seen.append(big.done)
        assert finished == ([big] if big.done == big.total else [])
    assert big.done == big.total == n and big.total_bytes == n * 4
    assert 60 <= len(seen) <= 66
    for w in big_out:
        np.testing.assert_array_equal(read(w, n, np.float32), big_in[0] + 1.0)


def test_tiny_job_submitted_mid_run_finishes_in_the_next_wave(fx):
    sched = WaveScheduler(chunk_bytes=512, wave_bytes=2048)
    big, _ = fx.job(C.ALLREDUCE, [np.ones(20_000, np.float32)] * 3)
    sched.submit(big)
    for _ in range(5):
        sched.run_wave()
    tiny, out = fx.job(C.BROADCAST, [np.arange(3, dtype=np.int64) * (r + 1) for r in range(2)], dtype="int64", root=1)
    sched.submit(tiny)
    _, finished = sched.run_wave()
    assert finished == [tiny]
    assert read(out[0], 3, np.int64).tolist() == [0, 2, 4]
    drain(sched)
    assert big.done == big.total


def test_round_robin_shares_a_wave_between_equal_jobs(fx):
    sched = WaveScheduler(chunk_bytes=1000, wave_bytes=4000)
    jobs = [fx.job(C.ALLREDUCE, [np.ones(2500, np.float32)] * 2)[0] for _ in range(4)]
    for j in jobs:
        sched.submit(j)
    progressed, finished = sched.run_wave()
    # one 1000-byte chunk each: 250 elements apiece, nobody ahead of anybody
    assert [j.done for j in jobs] == [250] * 4 and len(progressed) == 4 and finished == []
    waves = drain(sched)
    assert len(waves) == 9
    # they finish together, in submission order
    assert waves[-1][1] == jobs


def test_many_tiny_jobs_finish_in_one_wave_in_order(fx):
    sched = WaveScheduler(chunk_bytes=256, wave_bytes=4096)
    jobs = [fx.job(C.ALLREDUCE, [np.full(8, i, np.int32), np.full(8, 1, np.int32)], dtype="int32") for i in range(20)]
    for j, _ in jobs:
        sched.submit(j)
    _, finished = sched.run_wave()
    assert finished == [j for j, _ in jobs]
    assert not sched.busy
    for i, (_, out) in enumerate(jobs):
        assert read(out[1], 8, np.int32).tolist() == [i + 1] * 8


def test_wave_budget_is_respected(fx):
    sched = WaveScheduler(chunk_bytes=300, wave_bytes=1000)
    for k in range(3):
        sched.submit(fx.job(C.ALLREDUCE, [np.ones(997 + k, np.float64)] * 2, dtype="float64")[0])
    while sched.busy:
        before = sum(j.done * j.itemsize for j in sched.jobs)
        jobs = list(sched.jobs)
        sched.run_wave()
        spent = sum(j.done * j.itemsize for j in jobs) - before
        assert 0 < spent < 1000 + 300


def test_zero_sized_and_barrier_jobs_finish_at_once(fx):
    sched = WaveScheduler(chunk_bytes=64, wave_bytes=128)
    barrier, _ = fx.job(C.BARRIER, [np.empty(0, np.float32)] * 3)
    empty, _ = fx.job(C.ALLREDUCE, [np.empty(0, np.float32)] * 2)
    assert barrier.total == 0 and empty.total == 0
    sched.submit(barrier)
    sched.submit(empty)
    progressed, finished = sched.run_wave()
    assert finished == [barrier, empty] and not sched.busy


def test_chunk_smaller_than_an_element_still_progresses(fx):
    sched = WaveScheduler(chunk_bytes=1, wave_bytes=16)
    job, out = fx.job(C.ALLREDUCE, [np.arange(10, dtype=np.float64)] * 2, dtype="float64")
    sched.submit(job)
    waves = drain(sched)
    assert len(waves) == 5  # 2 elements of 8 bytes per 16-byte wave
    np.testing.assert_array_equal(read(out[0], 10, np.float64), np.arange(10) * 2.0)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 64, 1001])
def test_allgather_across_chunk_boundaries(fx, world, n):
    sched = WaveScheduler(chunk_bytes=40, wave_bytes=200)  # 10 elements: chunks straddle ranks
    xs = [np.arange(n, dtype=np.float32) + 1000 * r for r in range(world)]
    job, out = fx.job(C.ALLGATHER, xs)
    assert job.total == n * world
    sched.submit(job)
    drain(sched)
    for w in out:
        np.testing.assert_array_equal(read(w, n * world, np.float32), np.concatenate(xs))
    for r, (a, _) in enumerate(out):  # inputs untouched
        np.testing.assert_array_equal(a.bytes_view(0, n * 4).view(np.float32), xs[r])


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 13, 100])
@pytest.mark.parametrize("reduce_op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG])
def test_reduce_scatter_across_chunk_boundaries(fx, world, n, reduce_op):
    sched = WaveScheduler(chunk_bytes=28, wave_bytes=100)
    rng = np.random.default_rng(world * n)
    xs = [rng.integers(-50, 50, n * world).astype(np.int32) for _ in range(world)]
    job, out = fx.job(C.REDUCE_SCATTER, xs, dtype="int32", reduce_op=reduce_op)
    sched.submit(job)
    drain(sched)
    stack = np.stack(xs).astype(np.int64)
    full = {
        ReduceOp.SUM: stack.sum(0),
        ReduceOp.MAX: stack.max(0),
        ReduceOp.AVG: np.trunc(stack.sum(0) / world).astype(np.int64),
    }[reduce_op]
    for r, w in enumerate(out):
        np.testing.assert_array_equal(read(w, n, np.int32), full[r * n : (r + 1) * n])


@pytest.mark.parametrize("in_place", [True, False])
def test_chunked_broadcast(fx, in_place):
    sched = WaveScheduler(chunk_bytes=100, wave_bytes=300)
    xs = [np.full(777, r, np.int16) for r in range(3)]
    xs[2] = np.arange(777, dtype=np.int16)
    job, out = fx.job(C.BROADCAST, xs, dtype="int16", root=2, in_place=in_place)
    sched.submit(job)
    drain(sched)
    for w in out:
        np.testing.assert_array_equal(read(w, 777, np.int16), xs[2])


def test_chunked_bfloat16_allreduce(fx):
    sched = WaveScheduler(chunk_bytes=64, wave_bytes=256)
    rng = np.random.default_rng(9)
    bits = [bf16_bits(rng.standard_normal(1000).astype(np.float32)) for _ in range(2)]
    job, out = fx.job(C.ALLREDUCE, bits, dtype="bfloat16")
    assert job.itemsize == 2
    sched.submit(job)
    drain(sched)
    exact = bf16_to_f32(bits[0]) + bf16_to_f32(bits[1])  # exact in float32
    np.testing.assert_array_equal(read(out[0], 1000, np.uint16), bf16_bits(exact))


def test_in_place_output_is_the_input_view(fx):
    job, _ = fx.job(C.ALLREDUCE, [np.ones(5, np.float32)] * 2)
    assert all(o is i for o, i in zip(job.outputs, job.inputs))
    job, _ = fx.job(C.ALLREDUCE, [np.ones(5, np.float32)] * 2, in_place=False)
    assert not any(np.shares_memory(o, i) for o, i in zip(job.outputs, job.inputs))


def test_drop_removes_a_failed_communicators_jobs(fx):
    sched = WaveScheduler(chunk_bytes=64, wave_bytes=128)
    a, _ = fx.job(C.ALLREDUCE, [np.ones(1000, np.float32)] * 2)
    b, _ = fx.job(C.ALLREDUCE, [np.ones(1000, np.float32)] * 2)
    sched.submit(a)
    sched.submit(b)
    sched.run_wave()
    assert sched.drop(a.comm) == [a]
    assert list(sched.jobs) == [b]
    assert sched.drop(a.comm) == []
    drain(sched)
    assert b.done == b.total


def test_make_job_validates(fx):
    with pytest.raises(KernelError, match="does not split"):
        fx.job(C.REDUCE_SCATTER, [np.ones(10, np.float32)] * 3, out_numel=3)
    with pytest.raises(KernelError, match="not defined for bool"):
        fx.job(C.ALLREDUCE, [np.ones(4, bool)] * 2, dtype="bool", reduce_op=ReduceOp.AVG)
    with pytest.raises(KernelError, match="unsupported dtype"):
        fx.job(C.ALLREDUCE, [np.ones(4, np.complex64)] * 2, dtype="complex64")
    # an offset past the arena's end
    job, where = fx.job(C.ALLREDUCE, [np.ones(4, np.float32)] * 2)
    bad = [Posted(p.client, Collective(**{**p.request.__dict__, "in_off": 4096})) for p in job.posted]
    with pytest.raises(ArenaError, match="outside arena"):
        make_job(job.comm, bad, fx.arena_of)


def test_collectives_of_one_communicator_run_in_order(fx):
    sched = WaveScheduler(chunk_bytes=400, wave_bytes=800)
    first, _ = fx.job(C.ALLREDUCE, [np.ones(1000, np.float32)] * 2)
    second, _ = fx.job(C.ALLREDUCE, [np.ones(10, np.float32)] * 2)
    second.comm = first.comm  # same stream: the small one must wait for the big one
    other, _ = fx.job(C.ALLREDUCE, [np.ones(10, np.float32)] * 2)
    for j in (first, second, other):
        sched.submit(j)
    order = [j for _, fin in drain(sched) for j in fin]
    assert order.index(first) < order.index(second)
    assert order.index(other) < order.index(first)  # another communicator is not held up


def test_a_failing_kernel_fails_its_job_only(fx):
    sched = WaveScheduler()
    bad, _ = fx.job(C.ALLREDUCE, [np.ones(10, np.float32)] * 2)
    good, _ = fx.job(C.ALLREDUCE, [np.ones(10, np.float32)] * 2)

    def boom(job, a, b):
        raise FloatingPointError("kernel fault")

    bad.run_range = boom
    sched.submit(bad)
    sched.submit(good)
    _, finished = sched.run_wave()
    assert finished == [bad, good]
    assert isinstance(bad.error, FloatingPointError) and good.error is None
