"""Clocked mode agrees with itself (issue #16): real daemon, real ranks, emulated time.

Each test runs ``tests/fixtures/ml/clocked_probe.py`` on 2 emulated GPUs and checks
what the ranks measured with ``torch.cuda.Event`` against the daemon's
``coll_completed`` and the ranks' ``clocked_step`` events. Times are emulated, so
they do not depend on how loaded the machine is: the checks are tight.
"""

from __future__ import annotations

import json

import pytest

from test_run import FIXTURES, events, mirage_run

MIB = 1 << 20


def probe(tmp_path, name: str) -> tuple[dict[int, dict], list[dict]]:
    """Run the probe scenario ``name`` clocked on 2 GPUs: each rank's results, and the run's events."""
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--gpus-per-node", "2", "--nproc-per-node", "2",
                   "--env", f"PROBE={name}", "--", "python", str(FIXTURES / "clocked_probe.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    results = {}
    for line in r.stdout.splitlines():
        _, sep, payload = line.partition("] clocked_probe ")
        if sep:
            result = json.loads(payload)
            results[result["rank"]] = result
    assert set(results) == {0, 1}, r.stdout
    return results, events(tmp_path)


def all_reduces(ev: list[dict]) -> list[dict]:
    """The run's all-reduces, in order, with their emulated duration (s) added."""
    done = [e for e in ev if e["type"] == "coll_completed" and e["op"] == "allreduce"]
    return [dict(e, duration=e["emulated_end"] - e["emulated_start"]) for e in sorted(done, key=lambda e: e["seq"])]


@pytest.mark.usefixtures("no_orphans")
def test_twice_the_bytes_of_a_bandwidth_bound_all_reduce_take_twice_the_time(tmp_path):
    results, ev = probe(tmp_path, "scale")
    assert results[0] == {**results[1], "rank": 0}  # the same program: the same times on both ranks
    timed = {e["total_bytes"] // MIB: e for e in all_reduces(ev) if e["total_bytes"] >= MIB}
    assert sorted(timed) == [16, 32, 64]
    assert {e["algo"] for e in timed.values()} == {"ring/Simple"}  # bandwidth-bound: RCCL's Simple protocol
    for mib, e in timed.items():  # the rank's events see exactly the daemon's duration
        assert results[0][f"all_reduce_{mib}mib_ms"] == pytest.approx(e["duration"] * 1e3, rel=1e-9)
    d16, d32, d64 = (timed[m]["duration"] for m in (16, 32, 64))
    # twice the bytes, twice the time, but for the fixed latency (21 µs of 630 µs at 32 MiB)
    assert d64 / d32 == pytest.approx(2.0, rel=0.05)
    assert d32 / d16 == pytest.approx(2.0, rel=0.10)
    # the per-byte part alone is exactly linear: each doubling adds twice what the previous one did
    assert d64 - d32 == pytest.approx(2 * (d32 - d16), rel=1e-9)


@pytest.mark.usefixtures("no_orphans")
def test_a_rank_late_in_emulated_time_delays_the_collective_for_every_member(tmp_path):
    """Rank 1 computes before the all-reduce; rank 0 sleeps 0.5 s of wall time, which is no emulated time:
    the host is modeled as infinitely fast, so only work on the device (or a wait for it) moves a clock."""
    results, ev = probe(tmp_path, "straggler")
    fast, slow = results[0], results[1]
    assert fast["ready_ms"] == 0.0  # the sleep did not advance rank 0's clock
    assert slow["ready_ms"] > 0.5  # 200 kernels of ~4 µs
    aligned, timed = all_reduces(ev)[-2:]  # the probe's origin, then the all-reduce under test
    assert timed["total_bytes"] == MIB
    # it starts when its last member, in emulated time, is ready: rank 1, though rank 0 arrived last
    assert (timed["emulated_start"] - aligned["emulated_end"]) * 1e3 == pytest.approx(slow["ready_ms"], rel=1e-9)
    # both ranks leave it together, rank 0 having waited for rank 1, and stay shifted afterwards
    assert fast["after_ms"] == pytest.approx(slow["ready_ms"] + timed["duration"] * 1e3, rel=1e-9)
    assert slow["after_ms"] == pytest.approx(fast["after_ms"], rel=1e-9)
    assert fast["later_ms"] == pytest.approx(slow["later_ms"], rel=1e-9)
    assert fast["later_ms"] > fast["after_ms"]


@pytest.mark.usefixtures("no_orphans")
def test_compute_on_one_stream_overlaps_a_collective_on_another(tmp_path):
    results, ev = probe(tmp_path, "overlap")
    assert results[0] == {**results[1], "rank": 0}
    r = results[0]
    comm, compute = r["comm_ms"], r["compute_ms"]
    assert comm > compute > 0.1  # the all-reduce (16 MiB, ~330 µs) outlasts the 40 kernels (~160 µs)
    # async all-reduce + independent compute: the longer of the two, not their sum
    assert r["overlapped_ms"] == pytest.approx(max(comm, compute), rel=1e-9)
    # compute that reads the output after wait() runs after the all-reduce
    assert r["dependent_ms"] == pytest.approx(comm + compute, rel=1e-9)
    # DDP's way, get_future() without wait(): the independent compute overlaps, the reader waits for the data
    assert r["future_ms"] == pytest.approx(max(comm, compute) + compute, rel=1e-9)

    for rank in (0, 1):  # the clock's own account of each phase (one optimizer step each)
        steps = {e["step"]: e for e in ev if e["type"] == "clocked_step" and e["rank"] == rank}
        alone, overlapped, dependent, future = steps[2], steps[6], steps[8], steps[10]
        assert alone["exposed_comm_s"] == pytest.approx(alone["comm_s"], rel=1e-9)
        assert alone["comm_s"] * 1e3 == pytest.approx(comm, rel=1e-9)
        assert steps[4]["compute_s"] * 1e3 == pytest.approx(compute, rel=1e-9) and steps[4]["comm_s"] == 0
        # overlapped: only what the compute did not cover is exposed
        assert overlapped["exposed_comm_s"] * 1e3 == pytest.approx(comm - compute, rel=1e-9)
        assert (overlapped["t_end"] - overlapped["t_start"]) * 1e3 < comm + compute
        assert dependent["exposed_comm_s"] == pytest.approx(dependent["comm_s"], rel=1e-9)
        assert future["exposed_comm_s"] * 1e3 == pytest.approx(comm - compute, rel=1e-9)
