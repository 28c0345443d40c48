"""Clocked mode (--exec-mode clocked, issue #16): real daemon, real ranks, emulated time."""

from __future__ import annotations

import pytest

from shim.clock import _uncovered, _union
from test_run import FIXTURES, events, mirage_run


def test_exposed_communication_is_what_compute_does_not_cover():
    compute = _union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert compute == [(0.0, 2.0), (3.0, 4.0)]
    comm = _union([(1.5, 3.5), (5.0, 6.0)])
    # 1.5-2.0 and 3.0-3.5 are hidden behind compute; 2.0-3.0 and 5.0-6.0 are not
    assert _uncovered(comm, compute) == pytest.approx(2.0)
    assert _uncovered([], compute) == 0.0
    assert _uncovered(comm, []) == pytest.approx(3.0)


@pytest.mark.usefixtures("no_orphans")
def test_clocked_ddp_reports_steps_and_timed_collectives(tmp_path):
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--gpus-per-node", "2", "--", "torchrun", "--standalone",
                   "--nproc_per_node=2", str(FIXTURES / "ddp_mlp.py"), steps=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] ddp_mlp_ok" in r.stdout.splitlines()
    ev = events(tmp_path)
    assert next(e for e in ev if e["type"] == "daemon_ready")["exec_mode"] == "clocked"
    steps = {rank: [e for e in ev if e["type"] == "clocked_step" and e["rank"] == rank] for rank in (0, 1)}
    for rank, mine in steps.items():
        assert [e["step"] for e in mine] == list(range(1, 11)), rank
        for e in mine:
            assert e["t_end"] > e["t_start"] >= 0
            assert e["compute_s"] > 0 and e["comm_s"] > 0 and 0 <= e["exposed_comm_s"] <= e["comm_s"] + 1e-12
            assert e["ops"] > 0
        assert all(a["t_end"] == b["t_start"] for a, b in zip(mine, mine[1:]))
    # DDP keeps the replicas in lockstep: both ranks finish each step together in emulated time
    assert [e["t_end"] for e in steps[0]] == pytest.approx([e["t_end"] for e in steps[1]], rel=1e-9)
    timed = [e for e in ev if e["type"] == "coll_completed"]
    assert timed and all(e["emulated_end"] > e["emulated_start"] and e["algo"] for e in timed)


@pytest.mark.usefixtures("no_orphans")
def test_functional_mode_keeps_no_clock(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "ddp_mlp.py"), steps=3)
    assert r.returncode == 0, r.stdout + r.stderr
    ev = events(tmp_path)
    assert next(e for e in ev if e["type"] == "daemon_ready")["exec_mode"] == "functional"
    assert not [e for e in ev if e["type"] == "clocked_step"]
    assert all(e["emulated_end"] == 0 and not e["algo"] for e in ev if e["type"] == "coll_completed")


def test_clocked_in_process_is_refused(tmp_path):
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--in-process", "--", "python", "-c", "pass")
    assert r.returncode == 2
    assert "--exec-mode clocked needs the daemon" in r.stderr
