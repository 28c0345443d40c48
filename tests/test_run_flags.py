"""``mirage run --nproc-per-node``, ``--workdir``, ``--clear-env-vars`` and ``--debug-rank``: the real CLI,
daemon and ranks.

mirage starts the ranks itself with ``--nproc-per-node`` (torchrun's worker
environment, output per rank, every process reaped); ``--workdir`` and
``--clear-env-vars`` shape where and with what the command starts. Bad values
are one line and exit 2, as every usage error.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from test_cli_usage import mirage
from test_run import FIXTURES, REPO_ROOT, events, interrupt_when_sleeping, mirage_run, run_dir

from mirage_tui.cli import tui_main
from mirage_tui.config.launch_env import RankEnvironment, node_env
from mirage_tui.config.topology import CLEARED_ENV_KEEPS, Topology

pytestmark = pytest.mark.usefixtures("no_orphans")
RANK_ENV = str(FIXTURES / "rank_env.py")


def _lines(stdout: str, what: str) -> dict[int, str]:
    """``rank -> the rest of its '[r] [rank r] WHAT ...' line`` from rank_env.py's output."""
    out = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition(f" {what} ")
        if rest and head.startswith("[") and "[rank " in head:
            out[int(head[1:head.index("]")])] = rest
    return out


def test_nproc_per_node_trains_ddp_without_torchrun(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "ddp_mlp.py"), steps=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] [rank 0] training on cuda:0 (world_size=2, local_rank=0, backend=nccl)" in r.stdout
    assert "[1] [rank 1] training on cuda:1 (world_size=2, local_rank=1, backend=nccl)" in r.stdout
    assert "[0] [rank 0] all ranks converged with identical replicas" in r.stdout
    assert "[0] ddp_mlp_ok" in r.stdout.splitlines()
    assert "all 2 rank process(es) exited 0" in r.stderr
    d = run_dir(tmp_path)
    assert "ddp_mlp_ok" in (d / "rank-0.log").read_text()
    assert "training on cuda:1" in (d / "rank-1.log").read_text()
    assert not list(d.glob("node-*.log"))  # mirage started the ranks: no node process in between
    evs = events(tmp_path)
    registered = {e["rank"]: e["pid"] for e in evs if e["type"] == "rank_registered"}
    assert set(registered) == {0, 1}
    # one exit per node, once its last rank ended, as a node process's
    assert [(e["node"], e["returncode"]) for e in evs if e["type"] == "process_exited"] == [(0, 0)]


def test_nproc_per_node_gives_each_rank_torchruns_environment(tmp_path):
    r = mirage_run(tmp_path, "--num-nodes", "2", "--gpus-per-node", "2", "--nproc-per-node", "2", "--",
                   "python", RANK_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    env = _lines(r.stdout, "env")
    assert set(env) == {0, 1, 2, 3}
    session = run_dir(tmp_path).name.rsplit("-", 1)[1]
    port = env[0].split("MASTER_PORT=")[1].split()[0]
    for rank in range(4):
        node, local = divmod(rank, 2)
        assert env[rank] == (
            f"RANK={rank} LOCAL_RANK={local} WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK={node} GROUP_WORLD_SIZE=2 "
            f"ROLE_RANK={rank} ROLE_NAME=default ROLE_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            f"TORCHELASTIC_RUN_ID=mirage-{session} TORCHELASTIC_USE_AGENT_STORE=False OMP_NUM_THREADS=1 "
            f"NCCL_HOSTID=mirage-node-{node} MIRAGE_NODE_RANK={node}"
        )
    assert sorted(e["node"] for e in events(tmp_path) if e["type"] == "process_exited") == [0, 1]


def test_nproc_per_node_sets_what_torchrun_sets(tmp_path):
    """Every variable torchrun's agent gives a worker, mirage gives a rank it starts (bar torchrun's own files)."""
    ours = mirage_run(tmp_path / "ours", "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python", RANK_ENV)
    theirs = mirage_run(tmp_path / "torchrun", "--gpus-per-node", "2", "--", "torchrun", "--standalone",
                        "--nproc_per_node=2", RANK_ENV)
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr + theirs.stderr
    for rank in (0, 1):
        missing = set(_lines(theirs.stdout, "names")[rank].split()) - set(_lines(ours.stdout, "names")[rank].split())
        # the agent's error file (under its own log dir) and the signals it forwards; PWD/OLDPWD/_ are the shell's
        assert missing <= {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}, missing


def test_a_failing_rank_stops_the_others_and_names_itself(tmp_path):
    script = "import os, sys, time; print('up', flush=True); time.sleep(600) if os.environ['RANK'] == '0' else sys.exit(3)"
    start = time.monotonic()
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python", "-c", script)
    assert r.returncode == 3, r.stdout + r.stderr
    assert time.monotonic() - start < 60  # rank 0 was stopped after the grace period, not left to sleep
    assert f"rank 1 exited with code 3; log: {run_dir(tmp_path) / 'rank-1.log'}" in r.stderr
    assert "[0] up" in r.stdout and "[1] up" in r.stdout
    exits = [e for e in events(tmp_path) if e["type"] == "process_exited"]
    assert [(e["node"], e["returncode"]) for e in exits] == [(0, 3)]  # the node's code is its first failure's


def test_ctrl_c_stops_every_rank_process(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--num-nodes", "2",
         "--nproc-per-node", "2", "--", "python", str(FIXTURES / "sleeper.py")],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, err = interrupt_when_sleeping(proc, tmp_path, ranks=4)
    assert proc.returncode == 130, err
    assert "[3] rank 3 sleeping" in out


def test_workdir_is_where_the_command_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.sh").write_text("#!/bin/sh\necho \"in $(pwd)\"\n")
    (work / "train.sh").chmod(0o755)
    r = mirage_run(tmp_path / "runs", "--workdir", str(work), "--", "./train.sh")  # found in the workdir
    assert r.returncode == 0, r.stderr
    assert f"[node0] in {work}" in r.stdout
    # relative to the workdir: the program's own paths; relative to mirage's folder: --log-dir and the like
    r = mirage_run(tmp_path / "runs2", "--workdir", str(FIXTURES), "--nproc-per-node", "1", "--",
                   "python", "rank_env.py")
    assert r.returncode == 0, r.stderr
    assert _lines(r.stdout, "cwd") == {0: str(FIXTURES)}


def test_clear_env_vars_starts_from_an_almost_empty_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRAGE_TEST_PROBE", "from-the-parent")
    r = mirage_run(tmp_path / "plain", "--", "python", RANK_ENV)
    assert r.returncode == 0, r.stderr
    assert _lines(r.stdout, "probe") == {0: "from-the-parent"}
    r = mirage_run(tmp_path / "clear", "--clear-env-vars", "--env", "MY_SETTING=1", "--", "python", RANK_ENV)
    assert r.returncode == 0, r.stderr
    assert _lines(r.stdout, "probe") == {0: "-"}
    names = set(_lines(r.stdout, "names")[0].split())
    assert "MY_SETTING" in names and "PATH" in names
    mirage_set = {"MASTER_ADDR", "MASTER_PORT", "NCCL_HOSTID", "PYTHONUNBUFFERED", "PYTHONPATH", "MY_SETTING",
                  # set by the shim as the rank starts (shim/compile/triton_runtime.py), and once torch._dynamo
                  # is loaded (shim/compile/torch_compile.py), which a fork server's rank has from the start
                  "TRITON_INTERPRET", "TORCHINDUCTOR_CACHE_DIR"}
    extra = {n for n in names - mirage_set - set(CLEARED_ENV_KEEPS) if not n.startswith(("MIRAGE_", "LC_"))}
    assert not extra, extra


def test_clear_env_keeps_only_the_documented_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("LC_TIME", "C")
    monkeypatch.setenv("SECRET_TOKEN", "x")
    monkeypatch.setenv("MIRAGE_RANK_PID", "1")
    where = RankEnvironment(Topology(clear_env=True, command=("python",), env=(("A", "1"),)), session="abcd",
                            run_dir=str(tmp_path), token="t", endpoint=f"ipc://{tmp_path}/rpc.sock")
    env = node_env(where, 0, 1234)
    assert env["LC_TIME"] == "C" and env["A"] == "1" and env["PATH"] == os.environ["PATH"]
    assert "SECRET_TOKEN" not in env and env["MIRAGE_SESSION"] == "abcd"
    assert "MIRAGE_RANK_PID" not in env


BAD = [
    (["--nproc-per-node", "0"], "--nproc-per-node must be between 1 and 64, got 0"),
    (["--nproc-per-node", "-2"], "--nproc-per-node must be between 1 and 64, got -2"),
    (["--nproc-per-node", "65"], "--nproc-per-node must be between 1 and 64, got 65"),
    (["--nproc-per-node", "two"], "argument --nproc-per-node: invalid int value: 'two'"),
    (["--nproc-per-node", "1.5"], "argument --nproc-per-node: invalid int value: '1.5'"),
    (["--workdir", "/no/such/dir"], "--workdir /no/such/dir: no such directory (tried /no/such/dir)"),
    (["--workdir", str(REPO_ROOT / "README.md")], f"--workdir {REPO_ROOT / 'README.md'}: not a directory"),
    (["--workdir", ""], "--workdir must name a directory, got ''"),
    (["--in-process", "--nproc-per-node", "2"], "--in-process runs without the daemon"),
    (["--clear-env-vars=yes"], "argument --clear-env-vars: ignored explicit argument 'yes'"),
    (["--debug-rank", "one"], "argument --debug-rank: invalid int value: 'one'"),
    (["--gpus-per-node", "2", "--debug-rank", "2"],
     "--debug-rank must be a rank of the run, 0 to 1 (1 node(s) x 2 GPU(s)), got 2"),
    (["--debug-rank", "-1"], "--debug-rank must be a rank of the run, 0 to 0 (1 node(s) x 1 GPU(s)), got -1"),
    (["--num-nodes", "2", "--nproc-per-node", "3", "--debug-rank", "6"],
     "--debug-rank must be a rank of the run, 0 to 5 (2 node(s) x --nproc-per-node 3), got 6"),
    (["--in-process", "--gpus-per-node", "2", "--debug-rank", "1"],
     "--debug-rank must be a rank of the run, 0 to 0 (--in-process runs one process), got 1"),
]


@pytest.mark.parametrize("args,problem", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_and_exit_2(tmp_path, args, problem):
    r = mirage(tmp_path, "run", *args, "--", "python", "t.py")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("mirage: error: ") and problem in line and "--help" in line
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_mirage_tui_batch_takes_the_same_flags(tmp_path, capsys):
    assert tui_main(["--batch", "--nproc-per-node", "0", "--", "python", "t.py"]) == 2
    assert "mirage-tui: error: --nproc-per-node must be between 1 and 64, got 0" in capsys.readouterr().err
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from mirage_tui.cli import tui_main; sys.exit(tui_main())", "--batch",
         "--log-dir", str(tmp_path), "--nproc-per-node", "2", "--workdir", str(FIXTURES), "--clear-env-vars",
         "--", sys.executable, "rank_env.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "MIRAGE_TEST_PROBE": "x"},
    )
    assert r.returncode == 0, r.stderr
    assert _lines(r.stdout, "cwd") == {0: str(FIXTURES), 1: str(FIXTURES)}
    assert _lines(r.stdout, "probe") == {0: "-", 1: "-"}


def test_nproc_per_node_refuses_a_torchrun_command(tmp_path):
    r = mirage(tmp_path, "run", "--nproc-per-node", "2", "--", "torchrun", "--nproc_per_node=2", "t.py")
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert "--nproc-per-node makes mirage start the ranks itself, and torchrun would start its own" in line


def test_the_console_runs_what_the_flags_asked(tmp_path, monkeypatch):
    """The Setup form shows --nproc-per-node, --workdir and --clear-env-vars in its fields and the run it starts
    honours them."""
    pytest.importorskip("textual")
    import asyncio

    from mirage_tui.app.app import MirageApp
    from mirage_tui.app.setup import SetupScreen

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MIRAGE_TEST_PROBE", "x")
    topology = Topology(log_dir=str(tmp_path / "runs"), nproc_per_node=2, workdir=str(FIXTURES), clear_env=True,
                        command=(sys.executable, "rank_env.py"))
    app = MirageApp(topology, setup=True, demo=topology, last_path=str(tmp_path / "last.toml"))

    async def main() -> None:
        async with app.run_test(size=(140, 45)) as pilot:
            deadline = time.monotonic() + 60
            while not isinstance(app.screen, SetupScreen):
                assert time.monotonic() < deadline
                await pilot.pause(0.1)
            await pilot.pause(0.2)
            form = app.screen.topology
            assert form is not None and (form.nproc_per_node, form.workdir, form.clear_env) == (2, str(FIXTURES), True)
            await pilot.press("enter")
            while app.outcome is None:
                assert time.monotonic() < deadline, "the run never ended"
                await pilot.pause(0.1)
            await pilot.pause(0.2)

    try:
        asyncio.run(main())
    finally:
        app.stop_session()
    assert app.outcome.returncode == 0, app.outcome.summary
    d = run_dir(tmp_path / "runs")
    for rank in (0, 1):
        log = (d / f"rank-{rank}.log").read_text()
        assert f"cwd {FIXTURES}" in log and "probe -" in log and f"RANK={rank} LOCAL_RANK={rank}" in log


DEBUG_RANK = str(FIXTURES / "debug_rank.py")
_WAITS = re.compile(r"^\[1\] mirage: rank 1 \(pid \d+\) waits for a debugger: "
                    r"python -m mirage_tui\.debug_client (127\.0\.0\.1:\d+)$")
PROMPT = b"(Pdb rank 1) "


def _pdb(address: str, commands: list[str], pause_s: float) -> str:
    """Attach to the rank's pdb at ``address`` as a client, sit at its first prompt ``pause_s`` seconds, then send
    ``commands`` one prompt at a time; everything pdb printed until it hung up."""
    host, port = address.split(":")
    out = b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        for i, command in enumerate(commands):
            while not out.endswith(PROMPT):
                data = sock.recv(1 << 16)
                assert data, f"pdb hung up before {command!r}: {out!r}"
                out += data
            if i == 0:
                time.sleep(pause_s)
            sock.sendall(command.encode() + b"\n")
            out += b"\n"  # (so that the next prompt is a new one)
        while data := sock.recv(1 << 16):
            out += data
    return out.decode()


def test_debug_rank_waits_in_pdb_and_is_not_reported_as_a_hang(tmp_path):
    """Rank 1 stops before its program and at its breakpoint(); a client drives its pdb; sitting there longer
    than --hang-timeout (waiting for a client, then at the prompt) while rank 0 waits is no hang."""
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    env.pop("MIRAGE_DEBUGGER", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), "--gpus-per-node", "2",
         "--nproc-per-node", "2", "--hang-timeout", "4", "--debug-rank", "1", "--env", "BREAK_AGAIN=1", "--",
         sys.executable, DEBUG_RANK],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    err: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            err.append(line)
            lines.put(line.rstrip("\n"))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()

    def next_wait() -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                m = _WAITS.match(lines.get(timeout=1))
            except queue.Empty:
                continue
            if m:
                return m.group(1)
        pytest.fail(f"rank 1 never said it waits for a debugger: {''.join(err)}")

    try:
        address = next_wait()
        # before the program's first line; the stdlib client as a person would use it (three 'n': RANK is set)
        first = subprocess.run([sys.executable, "-m", "mirage_tui.debug_client", address],
                               input="n\nn\nn\np RANK\nc\n", capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert first.returncode == 0, first.stderr
        assert "debug_rank.py(1)<module>()" in first.stdout and "\n(Pdb rank 1) 1\n" in first.stdout
        # at breakpoint(), rank 0 already waiting in the next all_reduce: 5 s without a client, 5 s at the prompt
        assert next_wait() == address  # the same port, every stop
        time.sleep(5)
        second = _pdb(address, ["p RANK, t.tolist()", "c"], pause_s=5)
        assert "debug_rank.py(14)<module>()" in second and "(1, [3.0, 3.0, 3.0, 3.0])" in second
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=30)
    reader.join(10)
    stderr = "".join(err)
    assert proc.returncode == 0, stderr
    assert "[0] [rank 0] debug_rank_ok 24" in out and "[1] [rank 1] debug_rank_ok 24" in out
    assert "HANG" not in stderr
    assert (f"mirage: DEBUG: rank 1 is stopped and waits for a debugger (pdb): python -m mirage_tui.debug_client "
            f"{address}") in stderr
    evs = events(tmp_path)
    assert not [e for e in evs if e["type"] == "hang"]
    phases = [e["phase"] for e in evs if e["type"] == "rank_debugging"]
    assert phases.count("waiting") == 2 and phases[1] == "paused" and phases[-1] == "running", phases
    assert {(e["rank"], e["address"]) for e in evs if e["type"] == "rank_debugging"} == {(1, address)}
