"""Hang detection end to end: the daemon notices, the session diagnoses, the user reads who and where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_run import FIXTURES, REPO_ROOT, events, mirage_run, run_dir

pytestmark = pytest.mark.usefixtures("no_orphans")
HANG_TIMEOUT_S = 2.0


def test_skipped_all_reduce_is_reported_with_rank_seq_and_line(tmp_path):
    report_file = tmp_path / "report-copy.json"
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT_S),
                   "--report", str(report_file), "--",
                   "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "skip_allreduce.py"))
    assert r.returncode == 124, r.stderr
    assert "HANG: collective #3 (ALLREDUCE, 8 x float32) of communicator default_pg (2 ranks)" in r.stderr
    assert "missing ranks: {1}" in r.stderr
    assert "[1] finished collective #2, but didn't join collective #3" in r.stderr
    assert "skip_allreduce.py:17:<module>" in r.stderr  # where rank 0 waits
    assert 'skip_allreduce.py", line 16 in <module>' in r.stderr  # where rank 1 is instead

    d = run_dir(tmp_path)
    (report,) = json.loads((d / "hang-report.json").read_text())
    assert report["seq"] == 3 and report["op"] == "ALLREDUCE" and report["comm_label"] == "default_pg"
    assert [m["rank"] for m in report["missing"]] == [1]
    assert report["ranks"]["1"]["process"] in ("sleeping", "running")
    assert "skip_allreduce.py" in (d / "stacks.txt").read_text()

    run_report = json.loads(report_file.read_text())
    assert run_report == json.loads((d / "report.json").read_text())
    assert run_report["returncode"] == 124
    assert run_report["topology"]["gpus_per_node"] == 2
    assert run_report["nodes"]["0"]["returncode"] != 0
    assert set(run_report["ranks"]) == {"0", "1"}
    (comm,) = run_report["communicators"].values()
    assert comm["ranks"]["0"]["last_enqueued"] == 3 and comm["ranks"]["1"]["last_completed"] == 2
    assert run_report["hangs"][0]["missing"] == [1] and run_report["hangs"][0]["comm_label"] == "default_pg"
    assert (comm["desc"], comm["label"], comm["collectives"]) == ("default_pg", "default_pg", 2)

    evs = events(tmp_path)
    (hang,) = [e for e in evs if e["type"] == "hang"]
    arrived = min(e["t"] for e in evs if e["type"] == "coll_enqueued" and e["seq"] == 3)
    latency = hang["t"] - arrived
    assert HANG_TIMEOUT_S <= latency < HANG_TIMEOUT_S + 5  # generous: machines are noisy


def test_on_hang_wait_keeps_the_run_alive(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--gpus-per-node", "2",
         "--hang-timeout", str(HANG_TIMEOUT_S), "--on-hang", "wait", "--",
         "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "skip_allreduce.py")],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(tmp_path.glob("*/hang-report.json")):
            time.sleep(0.2)
        assert list(tmp_path.glob("*/hang-report.json")), "no hang reported"
        time.sleep(1)
        assert proc.poll() is None, "the run ended although --on-hang wait"
        status = subprocess.run([sys.executable, "-m", "mirage_tui", "status", "--log-dir", str(tmp_path)],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        assert ": live" in status.stdout
        rank0 = next(line for line in status.stdout.splitlines() if line.strip().startswith("0 "))
        assert "#3" in rank0 and "skip_allreduce.py:17" in rank0 and rank0.endswith("*")
        dumped = subprocess.run(
            [sys.executable, "-m", "mirage_tui", "status", "--fr-dump", "--log-dir", str(tmp_path)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
        )
        assert "Flight Recorder dumps:" in dumped.stdout, dumped.stderr
        assert sorted(p.name for p in tmp_path.glob("*/flight-recorder/*")) == [
            "nccl_trace_rank_0", "nccl_trace_rank_1"]
    finally:
        proc.send_signal(2)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "missing ranks: {1}" in err


def test_killed_rank_fails_its_waiting_peers_fast(tmp_path):
    start = time.monotonic()
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", "--",
                   "python", str(FIXTURES / "kill_rank.py"))
    took = time.monotonic() - start
    assert r.returncode == 128 + 9, r.stderr
    assert "rank 1 was killed by SIGKILL" in r.stderr
    # rank 0 does not wait for a timeout: it fails naming the dead rank
    assert "ncclRemoteError" in r.stderr
    assert "rank 1 (pid" in r.stderr and "exited while ranks {0} wait in collective #4" in r.stderr
    assert took < 60


def test_mismatched_sizes_fail_fast_on_every_rank(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "mismatch.py"))
    assert r.returncode != 0
    assert "silently wrong result" not in r.stdout
    assert "Detected mismatch between collectives on ranks. Rank 0 is running collective: " \
           "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[4]" in r.stderr
    assert "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, " \
           "TensorShape=[5]" in r.stderr
    assert "mismatch.py:13:<module>" in r.stderr  # the call sites are named
    for rank in (0, 1):
        assert "Detected mismatch" in (run_dir(tmp_path) / f"rank-{rank}.log").read_text()


def inject(tmp_path, action: str, hang_timeout_s: float = HANG_TIMEOUT_S):
    return mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", str(hang_timeout_s),
                      "--inject", f"rank=1,seq=5,action={action}", "--",
                      "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "allreduce_loop.py"))


def test_inject_hang(tmp_path):
    r = inject(tmp_path, "hang")
    assert r.returncode == 124, r.stderr
    assert "[1] mirage: injecting hang at collective #5 of rank 1" in r.stderr
    assert "missing ranks: {1}" in r.stderr
    assert "[1] finished collective #4, but didn't join collective #5" in r.stderr


def test_inject_crash(tmp_path):
    r = inject(tmp_path, "crash")
    assert r.returncode not in (0, 124), r.stderr
    assert "rank 1 was the first rank to go" in r.stderr


def test_inject_skip_leaves_a_rank_one_collective_behind(tmp_path):
    # a long hang timeout: the rank that skipped must be seen exiting first, and a loaded machine can take
    # seconds to tear its interpreter down (the report comes as soon as it is gone, not after the timeout)
    r = inject(tmp_path, "skip", hang_timeout_s=20.0)
    assert r.returncode != 0
    # rank 1 finishes its loop one collective early and exits; rank 0 waits for #10 in vain
    assert "[1] [rank 1] allreduce_loop_ok" in r.stdout
    assert "rank 1 (pid" in r.stderr and "exited while ranks {0} wait in collective #10" in r.stderr


def test_inject_delay_only_slows(tmp_path):
    r = inject(tmp_path, "delay:500ms")
    assert r.returncode == 0, r.stderr
    assert "[0] [rank 0] allreduce_loop_ok" in r.stdout


def test_straggler_is_warned_about_and_the_run_succeeds(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "3", "--", "torchrun", "--standalone", "--nproc_per_node=3",
                   str(FIXTURES / "slow_rank.py"))
    assert r.returncode == 0, r.stderr
    assert "mirage: warning: rank 1 arrived last at 5 collectives in a row" in r.stderr
    (warning,) = [e for e in events(tmp_path) if e["type"] == "straggler"]
    assert warning["rank"] == 1 and warning["mean_margin_s"] >= 0.25


def test_subgroup_hang_names_the_subgroup_and_leaves_the_default_group_alone(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "4", "--hang-timeout", str(HANG_TIMEOUT_S), "--",
                   "torchrun", "--standalone", "--nproc_per_node=4", str(FIXTURES / "subgroup_hang.py"))
    assert r.returncode == 124, r.stderr
    # a new_group without a group_desc: torch's name for it ("1", the first after the default group's "0")
    assert "of communicator group 1 (2 ranks) has waited" in r.stderr
    assert "joined ranks: {2}" in r.stderr and "missing ranks: {3}" in r.stderr
    assert "[3] never joined any collective of this communicator" in r.stderr
    hangs = [e for e in events(tmp_path) if e["type"] == "hang"]
    assert len(hangs) == 1  # the default group, where everyone finished, is not reported
    assert "mirage: communicator" not in r.stderr  # stopping the ranks after the report is not news


def test_mismatched_ops_fail_fast(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "mismatch_op.py"))
    assert r.returncode != 0
    assert "silently wrong result" not in r.stdout
    assert "Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE" in r.stderr
    assert "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=2, OpType=BROADCAST" in r.stderr


def test_rank_raising_under_ddp_ends_the_run_with_its_traceback(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "ddp_raise.py"))
    assert r.returncode != 0
    assert "rank 1 raised" in r.stderr
    assert "ValueError: bad batch on rank 1 at step 5" in (run_dir(tmp_path) / "rank-1.log").read_text()


def test_send_without_a_receive_is_a_hang(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT_S), "--",
                   "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "p2p_hang.py"))
    assert r.returncode == 124, r.stderr
    assert "HANG: message #1 (SEND, 4 x float32)" in r.stderr
    assert "[1] never posted the matching recv (message #1 between the two)" in r.stderr
    assert "p2p_hang.py:13:<module>" in r.stderr


_LATE_SIGNAL = """
import faulthandler, os, signal, sys, time
from shim.rank.output import arm_stack_dumps
os.makedirs(os.path.join(sys.argv[1], "ranks"))
arm_stack_dumps(sys.argv[1], 0)
os.kill(os.getpid(), signal.SIGUSR1)  # armed: the stacks are written
faulthandler.unregister(signal.SIGUSR1)  # what interpreter shutdown does
os.kill(os.getpid(), signal.SIGUSR1)  # a hang report's request reaching a rank that is tearing down
time.sleep(0.1)
print("survived")
"""


def test_a_stack_request_reaching_a_rank_at_shutdown_does_not_kill_it(tmp_path):
    """A hang report signals every rank for its stacks; one still exiting must not die of it (its
    launcher would take that for a failure and stop its peers: seen in the suite)."""
    r = subprocess.run([sys.executable, "-c", _LATE_SIGNAL, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "survived\n", (r.returncode, r.stdout, r.stderr)
    assert "File " in (tmp_path / "ranks" / "rank-0.stacks").read_text()


def test_set_pg_timeout_shortens_the_watchdog(tmp_path):
    """``_set_pg_timeout`` (torchtitan calls it after step 1) raised ``No backend type associated with device
    type cuda``; now rank 0 times out after the 2 s it set, in NCCL's words, while rank 1 sleeps 6 s."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--on-hang", "wait", "--hang-timeout", "30", "--",
                   "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "pg_timeout.py"))
    assert "[0] timeout after 2 s: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, " \
           "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=2000)" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
