"""The vertical slice end to end: the real ``mirage`` CLI, daemon, rank processes and torch.

Every test launches ``python -m mirage_tui run ...`` as a user would, with
torchrun or direct multi-node launch, and checks what the user sees (prefixed
lines, exit codes) and what the run directory keeps. The ``no_orphans``
fixture fails a test that leaves any process of the session behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "ml"
SOCKET_ENV = ["--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_SHM_DISABLE=1", "--env", "NCCL_SOCKET_IFNAME=lo"]

pytestmark = pytest.mark.usefixtures("no_orphans")


def mirage_run(tmp_path: Path, *args: str, steps: int = 20, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``mirage run --log-dir tmp_path ARGS`` with the venv's tools on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["STEPS"] = str(steps)
    env.pop("NO_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def run_dir(tmp_path: Path) -> Path:
    (only,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return only


def events(tmp_path: Path) -> list[dict]:
    with open(run_dir(tmp_path) / "events.jsonl") as f:
        return [json.loads(line) for line in f]


def test_torchrun_ddp_two_gpus(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "ddp_mlp.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] ddp_mlp_ok" in r.stdout.splitlines()
    assert "[0] [rank 0] all ranks converged with identical replicas" in r.stdout
    assert "[1] [rank 1] training on cuda:1" in r.stdout
    # torchrun's own lines are the node's, not a rank's
    assert "[node0]" in r.stderr
    d = run_dir(tmp_path)
    assert "ddp_mlp_ok" in (d / "rank-0.log").read_text()
    assert (d / "rank-1.log").exists()
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    kinds = [e["type"] for e in events(tmp_path)]
    assert "coll_completed" in kinds and kinds[-1] == "session_ended"
    assert "comm_failed" not in kinds and "mirage: communicator" not in r.stderr  # ranks ending is no failure
    done = [e for e in events(tmp_path) if e["type"] == "coll_completed"]
    # construction broadcast, parameter checks, then one or more buckets per step
    assert len(done) > 20


def test_torchrun_ddp_four_gpus(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "4", "--", "torchrun", "--standalone", "--nproc_per_node=4",
                   str(FIXTURES / "ddp_mlp.py"), steps=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] ddp_mlp_ok" in r.stdout
    assert "[3] [rank 3] training on cuda:3" in r.stdout


def test_two_nodes_direct_dist_smoke(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", *SOCKET_ENV, "--",
                   "python", str(FIXTURES / "dist_smoke.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] [rank 0] current device = 0 (cuda:0)" in r.stdout
    assert "[1] [rank 1] current device = 1 (cuda:1)" in r.stdout
    assert "[0] [rank 0] post all_reduce: tensor = 3.0" in r.stdout
    assert "[0] dist_smoke_ok" in r.stdout
    joined = [e for e in events(tmp_path) if e["type"] == "comm_joined"]
    assert {e["transport"] for e in joined} == {"socket"}


def test_two_nodes_direct_ddp(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", *SOCKET_ENV, "--",
                   "python", str(FIXTURES / "ddp_mlp.py"), steps=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] ddp_mlp_ok" in r.stdout


def test_duplicate_gpu_fails_with_nccl_wording(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "duplicate_gpu.py"))
    assert r.returncode != 0
    assert "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device" in r.stderr
    assert "ncclInvalidUsage" in r.stderr
    assert "NCCL WARN Duplicate GPU detected" in r.stderr


def test_rank_that_raises_ends_run_quickly(tmp_path):
    start = time.monotonic()
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", "--",
                   "python", str(FIXTURES / "raise_mid_training.py"))
    took = time.monotonic() - start
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rank 1 raised" in r.stderr
    log = (run_dir(tmp_path) / "rank-1.log").read_text()
    assert "Traceback (most recent call last)" in log
    assert "injected failure on rank 1 at step 3" in log
    # rank 0 is stuck in a collective its peer will never join: the session stops it
    assert took < 60


def test_missing_command_exits_127(tmp_path):
    r = mirage_run(tmp_path, "--", "no-such-program-xyz")
    assert r.returncode == 127
    assert "command not found: no-such-program-xyz" in r.stderr


def test_batch_flag_of_mirage_tui(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c",
         "import sys; from mirage_tui.cli import tui_main; sys.exit(tui_main())",
         "--batch", "--log-dir", str(tmp_path), "--gpus-per-node", "2", "--", "python", "-c",
         "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name(1))"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "[0] 2 AMD Instinct MI350X" in r.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "mirage_tui.commands.batch" in imported
    assert not [m for m in imported if m.startswith("textual")], "batch mode imported Textual"


def interrupt_when_sleeping(proc: subprocess.Popen, tmp_path: Path, ranks: int) -> tuple[str, str]:
    """Once ``ranks`` sleeper.py ranks of the run under ``tmp_path`` are up, Ctrl-C it; its (stdout, stderr)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logs = list(tmp_path.glob("*/rank-*.log"))
        if len(logs) == ranks and all("sleeping" in p.read_text() for p in logs):
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("ranks never started")
    proc.send_signal(2)  # SIGINT, as Ctrl-C does
    return proc.communicate(timeout=30)


def test_ctrl_c_stops_everything(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--gpus-per-node", "2", "--",
         "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "sleeper.py")],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, err = interrupt_when_sleeping(proc, tmp_path, ranks=2)
    assert proc.returncode == 130, err
    assert "interrupted by SIGINT" in err


def test_in_process_mode(tmp_path):
    single = ("import torch; a = torch.ones(2, device='cuda:0'); b = a.to('cuda:1') * 3; "
              "print(b.device, b.sum().item())")
    r = mirage_run(tmp_path / "one", "--in-process", "--gpus-per-node", "2", "--", "python", "-c", single)
    assert r.returncode == 0, r.stderr
    assert "[0] cuda:1 6.0" in r.stdout
    assert not (run_dir(tmp_path / "one") / "rpc.sock").exists()  # no daemon
    r = mirage_run(tmp_path / "two", "--in-process", "--gpus-per-node", "2", "--", "torchrun", "--standalone",
                   "--nproc_per_node=2", str(FIXTURES / "dist_smoke.py"))
    assert r.returncode != 0
    assert "--in-process gives each process its own emulator; multi-process collectives need the daemon" in r.stderr


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_collectives_match_their_definitions(tmp_path, ranks):
    r = mirage_run(tmp_path, "--gpus-per-node", str(ranks), "--nproc-per-node", str(ranks), "--", "python",
                   str(FIXTURES / "collectives_check.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] collectives_ok" in r.stdout


def test_collective_timeout_uses_the_watchdog_wording(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "late_rank.py"))
    assert r.returncode != 0
    assert ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
            "NumelIn=4, NumelOut=4, Timeout(ms)=2000) ran for") in r.stderr


def test_ddp_does_not_stall_over_many_steps(tmp_path):
    """The seed system stalled on DDP's repeated bucketed all-reduces after a few steps; this one must not."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "ddp_mlp.py"), steps=500)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] [rank 0] all ranks converged with identical replicas" in r.stdout
    done = [e for e in events(tmp_path) if e["type"] == "coll_completed"]
    assert len(done) >= 500
    assert [e["seq"] for e in done if e["comm"] == done[-1]["comm"]] == list(range(1, len(done) + 1))


@pytest.mark.parametrize("form", ["none", "mixed", "device_id"])
def test_init_process_group_forms(tmp_path, form):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--env", f"INIT_FORM={form}", "--nproc-per-node", "2", "--",
                   "python", str(FIXTURES / "init_forms.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[1] [rank 1] init_forms_ok" in r.stdout
    assert "default for cuda=nccl" in r.stdout


@pytest.mark.parametrize("launch, via", [("sockets", "NET/Socket/0"), ("p2p", "P2P/IPC/read")])
def test_nccl_debug_info_names_the_transport(tmp_path, launch, via):
    if launch == "sockets":
        args = ["--num-nodes", "2", "--gpus-per-node", "2", *SOCKET_ENV, "--", "python"]
    else:
        args = ["--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2"]
    r = mirage_run(tmp_path, "--env", "NCCL_DEBUG=INFO", *args, str(FIXTURES / "dist_smoke.py"))
    assert r.returncode == 0, r.stderr
    assert f"[0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via {via}" in r.stdout
    assert "NCCL INFO ncclCommInitRankConfig comm 0x" in r.stdout and "busId 2000" in r.stdout
    assert r.stdout.count("- Init COMPLETE") == 2


@pytest.mark.parametrize("ranks", [2, 3])
def test_point_to_point(tmp_path, ranks):
    r = mirage_run(tmp_path, "--gpus-per-node", str(ranks), "--nproc-per-node", str(ranks), "--", "python",
                   str(FIXTURES / "p2p_check.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f"[{k}] [rank {k}] p2p_ok" in r.stdout for k in range(ranks))


def test_a_shell_script_workload_still_gets_the_shim(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text('#!/bin/sh\necho "from the shell"\n'
                      'exec python -c "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name())"\n')
    script.chmod(0o755)
    r = mirage_run(tmp_path / "runs", "--gpus-per-node", "3", "--", str(script))
    assert r.returncode == 0, r.stderr
    assert "[node0] from the shell" in r.stdout  # the shell is the node process, python the rank
    assert "[0] 3 AMD Instinct MI350X" in r.stdout


def test_cuda_visible_devices_narrows_each_rank_to_its_gpu(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                   str(FIXTURES / "visible_devices.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    uuids = {line.rsplit("uuid=", 1)[1] for line in r.stdout.splitlines() if "visible_devices_ok" in line}
    assert len(uuids) == 2  # two different GPUs, both seen as cuda:0


def test_visible_devices_parsing():
    from shim.device.state import visible_devices

    assert visible_devices(4, {}) == [0, 1, 2, 3]
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert visible_devices(4, {"HIP_VISIBLE_DEVICES": "3,1", "CUDA_VISIBLE_DEVICES": "1"}) == [1]
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "1,9,2"}) == [1]  # stops at the first bad entry
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": ""}) == []
