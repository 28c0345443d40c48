"""Forming the world: what a node's command sees, ranks started by launchers other than torchrun,
and a world that never forms reported as a hang (real CLI, daemon, ranks and torch)."""

from __future__ import annotations

import json
import os

import pytest
from test_run import FIXTURES, events, mirage_run, run_dir

from emulator.hang import HangDetector
from emulator.ledger import Worlds
from wire.schema import HangKind, WorldFormation, WorldPhase

pytestmark = pytest.mark.usefixtures("no_orphans")
HANG_TIMEOUT_S = 2.0
UNSET = "RANK=- WORLD_SIZE=- LOCAL_RANK=- GROUP_RANK=- LOCAL_WORLD_SIZE=-"


def test_a_single_node_command_gets_no_per_rank_variables(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "python", str(FIXTURES / "env_probe.py"))
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("[0] env ")]
    assert f"[0] env {UNSET} MASTER_ADDR=127.0.0.1 MASTER_PORT=" in line
    assert line.endswith("NCCL_HOSTID=mirage-node-0 MIRAGE_NODE_RANK=0")


def test_per_rank_variables_the_user_exported_pass_through(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as in a shell: PyTorch's DistributedTest is driven this way
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--env", "RANK=0", "--", "python",
                   str(FIXTURES / "env_probe.py"))
    assert r.returncode == 0, r.stderr
    assert "[0] env RANK=0 WORLD_SIZE=2 LOCAL_RANK=- " in r.stdout


def test_direct_multi_node_form_keeps_env_variables(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "1", "--", "python",
                   str(FIXTURES / "env_probe.py"))
    assert r.returncode == 0, r.stderr
    for node in (0, 1):
        assert (f"[{node}] env RANK={node} WORLD_SIZE=2 LOCAL_RANK=0 GROUP_RANK=- LOCAL_WORLD_SIZE=- "
                f"MASTER_ADDR=127.0.0.1") in r.stdout


def test_mp_spawn_ranks_train_and_are_named_by_their_own_rank(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "python", str(FIXTURES / "spawn_ddp.py"),
                   str(_free_port()))
    assert r.returncode == 0, r.stdout + r.stderr
    # each child claims its rank when it forms the world: its lines, registration and stacks are its own
    for rank in (0, 1):
        assert f"[{rank}] [rank {rank}] rank={rank} replicas identical and equal to the reference" in r.stdout
        assert f"[{rank}] [rank {rank}] step 19 loss" in r.stdout
    assert "[0] spawn_ddp_ok" in r.stdout
    evs = events(tmp_path)
    node_pid = next(e["pid"] for e in evs if e["type"] == "process_exited")
    registered = {e["rank"]: e["pid"] for e in evs if e["type"] == "rank_registered"}  # the last word wins
    assert set(registered) == {0, 1} and node_pid not in registered.values()
    assert (run_dir(tmp_path) / "ranks" / "rank-1.stacks").exists()
    formed = [e for e in evs if e["type"] == "world" and e["phase"] == "formed"]
    assert sorted(e["rank"] for e in formed) == [0, 1] and "spawn_ddp.py" in formed[0]["site"]
    assert not [e for e in evs if e["type"] == "hang"]


def test_a_rank_that_leaves_before_init_is_reported_as_a_world_hang(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "1", "--hang-timeout", str(HANG_TIMEOUT_S),
                   "--env", "EXIT_RANK=1", "--", "python", str(FIXTURES / "world_never_forms.py"))
    assert r.returncode == 124, r.stdout + r.stderr
    assert "HANG: world formation (init_process_group) of env://127.0.0.1:" in r.stderr
    assert "(2 ranks) has waited" in r.stderr
    assert "missing ranks: {1}" in r.stderr
    assert "[0] waits in init_process_group at " + str(FIXTURES / "world_never_forms.py") + ":14:<module>" in r.stderr
    assert f'now at: File "{FIXTURES / "world_never_forms.py"}", line 14 in <module>' in r.stderr  # rank 0's stack
    assert "rank 1 never registered" in r.stderr
    assert "hang in world formation (init_process_group)" in r.stderr  # the summary

    d = run_dir(tmp_path)
    (report,) = json.loads((d / "hang-report.json").read_text())
    assert report["kind"] == "world" and [m["rank"] for m in report["missing"]] == [1]
    assert report["ranks"]["1"]["process"] == "exited"
    assert 'world_never_forms.py", line 14' in report["ranks"]["0"]["stacks"]
    (run_hang,) = json.loads((d / "report.json").read_text())["hangs"]
    assert run_hang["kind"] == "world" and run_hang["missing"] == [1]
    evs = events(tmp_path)
    (hang,) = [e for e in evs if e["type"] == "hang"]
    joined = next(e["t"] for e in evs if e["type"] == "world" and e["phase"] == "joining")
    assert HANG_TIMEOUT_S <= hang["t"] - joined < HANG_TIMEOUT_S + 5  # generous: machines are noisy


def test_a_wrong_world_size_is_reported_as_a_world_hang(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "1", "--hang-timeout", str(HANG_TIMEOUT_S),
                   "--env", "WORLD_SIZE=3", "--", "python", str(FIXTURES / "world_never_forms.py"))
    assert r.returncode == 124, r.stdout + r.stderr
    assert "(3 ranks) has waited" in r.stderr
    assert "joined ranks: {0, 1}" in r.stderr and "missing ranks: {2}" in r.stderr
    assert "rank 2 never registered" in r.stderr
    assert "process ?: unknown (never registered)" in r.stderr


# ---------------------------------------------------------------- the books, without processes


def _join(worlds: Worlds, rank: int, pid: int, phase=WorldPhase.JOINING, world="env://h:1 #1", size=2):
    worlds.record(WorldFormation(world=world, rank=rank, size=size, pid=pid, site=f"s{rank}", phase=phase),
                  alive=lambda p, h: p > 0)


def test_a_world_hangs_only_while_a_live_rank_waits_for_missing_ones():
    worlds, detector = Worlds(), HangDetector(timeout_s=1.0)
    _join(worlds, 0, pid=10)
    assert detector.scan_worlds(worlds, alive=lambda p, h: p > 0) == []  # not yet past the timeout
    (hang,) = detector.scan_worlds(worlds, alive=lambda p, h: p > 0, now=worlds.worlds["env://h:1 #1"].arrived[0].at + 1)
    assert (hang.kind, hang.joined, hang.sites, hang.missing, hang.size) == (HangKind.WORLD, [0], ["s0"], [1], 2)
    assert detector.scan_worlds(worlds, alive=lambda p, h: p > 0, now=1e12) == []  # once

    worlds, detector = Worlds(), HangDetector(timeout_s=1.0)
    _join(worlds, 0, pid=-1)  # the waiting rank died: nobody waits
    assert detector.scan_worlds(worlds, alive=lambda p, h: p > 0, now=1e12) == []


def test_a_formed_world_leaves_the_books_and_its_name_can_form_again():
    worlds = Worlds()
    for phase in (WorldPhase.JOINING, WorldPhase.FORMED):
        for rank in (0, 1):
            _join(worlds, rank, pid=10 + rank, phase=phase)
    assert worlds.worlds == {}
    # formed lazily (a store passed in, nobody waits): the name stays, and new processes start it afresh
    _join(worlds, 0, pid=10)
    _join(worlds, 0, pid=10, phase=WorldPhase.FORMED)
    _join(worlds, 0, pid=20)
    assert {r: a.pid for r, a in worlds.worlds["env://h:1 #1"].arrived.items()} == {0: 20}
    _join(worlds, 0, pid=20, phase=WorldPhase.FAILED)
    assert worlds.worlds == {}


def test_the_daemon_reports_a_world_a_live_rank_waits_to_form_and_refuses_bad_ones():
    from daemon_client import DaemonProcess, Events

    from wire import schema as s

    d = DaemonProcess(hang_timeout_s=0.3)
    try:
        c = d.client()
        for rank, size in ((0, 0), (2, 2), (-1, 2), (0, 1 << 17)):
            rep = c.call(WorldFormation(world="w #1", rank=rank, size=size, pid=os.getpid()))
            assert isinstance(rep, s.Error) and rep.code == "ncclInvalidArgument", rep
        events = Events(d)
        try:
            # a world that forms is never reported; one where this (live) process waits for rank 1 is
            for phase in (WorldPhase.JOINING, WorldPhase.FORMED):
                assert isinstance(c.call(WorldFormation(world="ok #1", size=1, pid=os.getpid(), phase=phase)), s.Ok)
            assert isinstance(c.call(WorldFormation(world="w #1", size=2, pid=os.getpid(), site="x.py:3:f")), s.Ok)
            hang = events.until(lambda e: isinstance(e, s.HangDetected))[-1]
        finally:
            events.close()
        assert (hang.kind, hang.comm, hang.joined, hang.sites, hang.missing) == (
            HangKind.WORLD, "w #1", [0], ["x.py:3:f"], [1])
        assert hang.waited_s >= 0.3
    finally:
        d.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
