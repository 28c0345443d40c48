"""Faults during a run: each ends promptly, with its own exit code and a summary naming the cause,
the logs and ``events.jsonl`` complete up to the fault, and nothing left behind.

Real ``mirage run`` sessions; the ``no_orphans`` fixture checks that no process
of the session and no /dev/shm segment of it survives. Workloads avoid torch
where the case does not need a collective, to keep the suite fast. Already
covered elsewhere (see docs/reliability.md): SIGKILL of one rank mid-collective
(tests/test_hang.py::test_killed_rank_fails_its_waiting_peers_fast), Ctrl-C
(tests/test_run.py::test_ctrl_c_stops_everything).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_run import REPO_ROOT, mirage_run, run_dir

from mirage_tui.state.runstate import read_journal
from wire import schema as s

WORKLOADS = Path(__file__).resolve().parent / "workloads"
#: "Promptly": generous, for a loaded CI machine; the figures in docs/reliability.md are far below.
PROMPT_S = 20
pytestmark = pytest.mark.usefixtures("no_orphans")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    env.pop("NO_COLOR", None)
    env.update(extra)
    return env


_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _stop_leftover_runs(no_orphans):
    """A test that failed half-way must not leave its ``mirage run`` going (no_orphans checks after this)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def start(tmp_path: Path, *args: str, preexec_fn=None, **extra_env: str) -> subprocess.Popen[str]:
    """``mirage run --log-dir tmp_path ARGS`` in the background."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(tmp_path), *args],
        cwd=REPO_ROOT, env=_env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=preexec_fn,
    )
    _started.append(proc)
    return proc


def wait_for(pred, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def log_has(tmp_path: Path, name: str, text: str) -> bool:
    logs = list(tmp_path.glob(f"*/{name}"))
    return bool(logs) and text in logs[0].read_text(errors="replace")


def journal(tmp_path: Path) -> list[s.Event]:
    """The run's events, checking that every line of the file is one (nothing half-written)."""
    path = run_dir(tmp_path) / "events.jsonl"
    events = list(read_journal(str(path)))
    with open(path, "rb") as f:
        assert sum(1 for _ in f) == len(events), "events.jsonl holds lines that are not events"
    return events


def ended(events: list[s.Event], code: int) -> s.SessionEnded:
    assert isinstance(events[-1], s.SessionEnded), events[-1]
    assert events[-1].returncode == code
    return events[-1]


def running(pids) -> list[int]:
    """Those of ``pids`` still running (an exited process not yet reaped does not count)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def all_gone(pids, timeout_s: float = 10) -> None:
    wait_for(lambda: not running(pids), f"processes {sorted(pids)} to end", timeout_s)


def session_pids(tmp_path: Path) -> set[int]:
    session = run_dir(tmp_path).name.rsplit("-", 1)[1]
    out = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("MIRAGE_SESSION") == session:
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


# ---------------------------------------------------------------- processes killed


def test_daemon_killed_mid_collective(tmp_path):
    """Ranks waiting on a dead daemon fail at once with a message; the session names the daemon's death."""
    proc = start(tmp_path, "--num-nodes", "2", "--hang-timeout", "120", "--", "python",
                 str(WORKLOADS / "wait_in_allreduce.py"))
    wait_for(lambda: log_has(tmp_path, "rank-0.log", "waiting in all_reduce #3"), "rank 0 to block")
    time.sleep(0.3)  # inside the collective now
    daemon = next(e for e in journal_so_far(tmp_path) if isinstance(e, s.DaemonReady)).pid
    os.kill(daemon, signal.SIGKILL)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < PROMPT_S
    assert proc.returncode == 125, err
    assert f"mirage: FAILED: the mirage daemon (pid {daemon}) was killed by SIGKILL during the run" in err
    # the waiting rank did not wait out a timeout: it raised naming the daemon
    rank0 = (run_dir(tmp_path) / "rank-0.log").read_text()
    assert f"DaemonGone: mirage: the emulator daemon (pid {daemon}) is gone, so no collective can complete" in rank0
    events = journal(tmp_path)
    assert "daemon was killed by SIGKILL" in ended(events, 125).summary.replace(f" (pid {daemon})", "")
    done = [e.seq for e in events if isinstance(e, s.CollectiveCompleted)]
    assert done == [1, 2]
    assert [e.rank for e in events if isinstance(e, s.CollectiveEnqueued) and e.seq == 3] == [0]


def journal_so_far(tmp_path: Path) -> list[s.Event]:
    return list(read_journal(str(next(tmp_path.glob("*/events.jsonl")))))


def test_torchrun_agent_killed(tmp_path):
    """The agent's workers run in sessions of their own; they must not outlive it."""
    proc = start(tmp_path, "--gpus-per-node", "2", "--hang-timeout", "120", "--", "torchrun", "--standalone",
                 "--nproc_per_node=2", str(WORKLOADS / "wait_in_allreduce.py"))
    wait_for(lambda: log_has(tmp_path, "rank-0.log", "waiting in all_reduce #3"), "rank 0 to block")
    agent = next(c for c in psutil.Process(proc.pid).children() if os.path.basename(c.cmdline()[1]) == "torchrun")
    workers = agent.children(recursive=True)
    assert len(workers) == 2 and all(os.getsid(w.pid) != os.getsid(agent.pid) for w in workers)
    agent.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < PROMPT_S
    assert proc.returncode == 128 + 9, err
    assert "mirage: FAILED: node 0 (torchrun's agent) was killed by SIGKILL" in err
    all_gone([w.pid for w in workers])
    events = journal(tmp_path)
    ended(events, 137)
    assert [e.returncode for e in events if isinstance(e, s.ProcessExited)] == [-9]
    assert "all_reduce #2 done: 4" in (run_dir(tmp_path) / "rank-1.log").read_text()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_mirage_run_tears_down(tmp_path, sig, code):
    """SIGTERM (a CI runner's cancel) and SIGINT stop every node; the journal records why."""
    proc = start(tmp_path, "--num-nodes", "2", "--", "python", str(REPO_ROOT / "tests" / "fixtures" / "ml" / "sleeper.py"))
    wait_for(lambda: all(log_has(tmp_path, f"rank-{r}.log", "sleeping") for r in (0, 1)), "both ranks to start")
    pids = session_pids(tmp_path)
    assert len(pids) >= 3  # the daemon and two ranks
    proc.send_signal(sig)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < PROMPT_S
    assert proc.returncode == code, err
    assert f"interrupted by {sig.name}; run stopped" in err
    all_gone(pids)
    events = journal(tmp_path)
    assert ended(events, code).summary == f"interrupted by {sig.name}; run stopped"
    report = json.loads((run_dir(tmp_path) / "report.json").read_text())
    assert report["returncode"] == code


def test_sigkill_of_mirage_run_itself(tmp_path):
    """No session left to tear down: the nodes and the daemon die with it (the daemon first stops the ranks it
    knows and removes their arenas)."""
    proc = start(tmp_path, "--num-nodes", "2", "--hang-timeout", "120", "--", "python",
                 str(WORKLOADS / "wait_in_allreduce.py"))
    wait_for(lambda: log_has(tmp_path, "rank-0.log", "waiting in all_reduce #3"), "rank 0 to block")
    pids = session_pids(tmp_path)
    assert len(pids) >= 3  # the daemon and two ranks (one in a collective, one sleeping)
    proc.kill()
    proc.wait()
    all_gone(pids, PROMPT_S)
    session = run_dir(tmp_path).name.rsplit("-", 1)[1]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mirage-{session}-")]
    # the kernel signals the nodes (PR_SET_PDEATHSIG) and the daemon stops the ranks it knows: whichever is first
    assert "the session went away; stopped" in (run_dir(tmp_path) / "daemon.log").read_text()


def test_sigkill_of_mirage_run_takes_nodes_that_never_registered(tmp_path):
    """A node the daemon never heard of (no torch, no Hello) still goes: the kernel signals it when the session dies."""
    proc = start(tmp_path, "--num-nodes", "2", "--", "python", "-c",
                 "import time; print('sleeping', flush=True); time.sleep(120)")
    def started() -> bool:
        try:
            return len(session_pids(tmp_path)) >= 3
        except ValueError:  # no run directory yet
            return False

    wait_for(started, "the daemon and both nodes")
    pids = session_pids(tmp_path)
    proc.kill()
    proc.wait()
    all_gone(pids, PROMPT_S)


# ---------------------------------------------------------------- ranks misbehaving


def test_rank_that_forks_children_and_exits(tmp_path):
    start_t = time.monotonic()
    r = mirage_run(tmp_path, "--", "python", str(WORKLOADS / "forker.py"))
    assert time.monotonic() - start_t < PROMPT_S  # the session does not wait for the children
    assert r.returncode == 0, r.stderr
    children = [int(m) for m in re.findall(r"child pid=(\d+)", r.stdout)]
    assert len(children) == 2, r.stdout
    all_gone(children)  # killed, not left orphaned
    ended(journal(tmp_path), 0)


def test_rank_that_closes_its_stdout(tmp_path):
    r = mirage_run(tmp_path, "--", "python", str(WORKLOADS / "close_stdout.py"))
    assert r.returncode == 0, r.stderr
    assert "[0] before closing stdout" in r.stdout
    assert "[0] stdout is closed (errno 9)" in r.stderr
    assert "[0] still running 2" in r.stderr
    events = journal(tmp_path)
    ended(events, 0)
    assert "still running 2" in (run_dir(tmp_path) / "rank-0.log").read_text()


def test_output_flood_and_a_line_without_end(tmp_path):
    """5 MiB of lines and a 10 MiB line with no newline: all recorded, in readable pieces, the run ends.

    (200 MiB of lines takes about 35 s and is measured by bench/output_flood.py.)"""
    started = time.monotonic()
    r = mirage_run(tmp_path, "--env", "OUT_MB=5", "--env", "LINE_MB=10", "--", "python",
                   str(WORKLOADS / "big_output.py"))
    took = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-2000:]
    assert took < 120
    events = journal(tmp_path)  # every line of the journal is a readable event
    ended(events, 0)
    out = [e.text for e in events if isinstance(e, s.OutputLine) and e.rank == 0 and e.stream is s.Stream.STDOUT]
    lines = int(re.search(r"\[0\] flood done: (\d+) lines", r.stderr).group(1))
    assert lines == 5 * (1 << 20) // 100
    assert out[:lines] == ["x" * 99] * lines
    long = out[lines:]
    assert "".join(long) == "L" * (10 << 20)  # the long line, whole, in 64 KiB pieces
    assert max(map(len, long)) == 1 << 16
    log = run_dir(tmp_path) / "rank-0.log"
    stderr_line = f"flood done: {lines} lines\n"  # the log holds both streams
    assert log.stat().st_size == lines * 100 + (10 << 20) + len(long) + len(stderr_line)


# ---------------------------------------------------------------- the machine


def test_run_directory_filling_up_stops_the_run(tmp_path):
    """The disk filling up (a 4 MiB file-size limit on the session: each write past it fails with EFBIG)."""
    limit = 4 << 20

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = start(tmp_path, "--", "python", str(WORKLOADS / "paced_output.py"), preexec_fn=small_disk, SECONDS_="60")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 74, err[-2000:]
    journal_path = run_dir(tmp_path) / "events.jsonl"
    assert (f"mirage: FAILED: could not write the run directory ({journal_path}: File too large); the run was "
            f"stopped so that no output is lost silently") in err
    assert "Traceback" not in err
    # stopped at the limit, not after the workload's full minute
    events = list(read_journal(str(journal_path)))
    assert 0 < journal_path.stat().st_size <= limit
    lines = [e.text for e in events if isinstance(e, s.OutputLine) and e.rank == 0]
    assert len(lines) > 1000 and [int(t[:8]) for t in lines] == list(range(len(lines)))  # in order, no gap
    report = json.loads((run_dir(tmp_path) / "report.json").read_text())
    assert report["returncode"] == 74 and "File too large" in report["summary"]


def test_run_directory_on_a_full_filesystem_stops_the_run(tmp_path):
    """A real ENOSPC: the run directory on a 4 MiB tmpfs (needs the right to mount; skipped without it)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        proc = start(small, "--", "python", str(WORKLOADS / "paced_output.py"), SECONDS_="60",
                     SURVIVE_WRITE_ERRORS="1")
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 74, err[-2000:]
        journal_path = run_dir(small) / "events.jsonl"
        # the journal or a rank log, whichever the session wrote when the disk filled, or the ranks' own
        # files (the session saw the disk full before it wrote again)
        assert re.search(rf"mirage: FAILED: could not write the run directory \({re.escape(str(run_dir(small)))}/"
                         r"(events\.jsonl|rank-0\.log|ranks): No space left on device\); the run was stopped", err), err[-2000:]
        assert "Traceback" not in err
        lines = [e.text for e in read_journal(str(journal_path)) if isinstance(e, s.OutputLine) and e.rank == 0]
        seqs = [int(t[:8]) for t in lines]
        assert len(seqs) > 500 and seqs == sorted(set(seqs))  # in order, none twice
        # nothing of the session is left (checked here: the run directory goes with the mount)
        session = run_dir(small).name.rsplit("-", 1)[1]
        wait_for(lambda: not session_pids(small), "the session's processes to end", 10)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mirage-{session}-")]
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_two_sessions_at_once_are_isolated(tmp_path):
    """Two runs on one machine: separate sessions, sockets, ports, run directories and communicators."""
    procs = [start(tmp_path / name, "--num-nodes", "2", "--", "python", str(WORKLOADS / "mini_allreduce.py"))
             for name in ("a", "b")]
    results = [p.communicate(timeout=120) for p in procs]
    seen = []
    for name, p, (out, err) in zip(("a", "b"), procs, results):
        assert p.returncode == 0, err
        assert out.count("mini sum=3") == 2, out  # ranks 1 and 2 of this session, and no one else's
        ids = set(re.findall(r"session=(\w+) endpoint=(\S+) port=(\d+)", out))
        assert len(ids) == 1, ids  # both ranks of a run agree
        d = run_dir(tmp_path / name)
        session, endpoint, port = ids.pop()
        assert d.name.endswith(session) and endpoint == f"ipc://{d}/rpc.sock"
        comms = {e.comm for e in journal(tmp_path / name) if isinstance(e, s.CommJoined)}
        assert comms == {session}
        seen.append((session, endpoint, port))
    assert len({x[0] for x in seen}) == len({x[1] for x in seen}) == len({x[2] for x in seen}) == 2


def test_reader_of_mirages_output_going_away(tmp_path):
    """``mirage run ... | head -1``: the display's reader is gone; the run goes on, recorded, without a traceback
    per line (there used to be one for every line after the pipe closed)."""
    # 30,000 lines: more than a pipe holds, so the display must write after the reader left
    proc = start(tmp_path, "--", "python", "-c", "for i in range(30000): print(i)")
    assert proc.stdout.readline() == "[0] 0\n"
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read()
    assert proc.wait(60) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[:2000]
    events = journal(tmp_path)
    ended(events, 0)
    assert [e.text for e in events if isinstance(e, s.OutputLine) and e.rank == 0] == [str(i) for i in range(30000)]


def test_orphaned_daemon_stops_only_processes_of_its_session(tmp_path):
    """The clean-up after a SIGKILLed session kills a Hello's pid only if that process carries the session's id:
    a client could name any pid (init, a stranger)."""
    import secrets
    import shutil
    import tempfile

    import zmq

    from wire.endpoints import endpoints

    session, token = secrets.token_hex(4), secrets.token_hex(16)
    run = tempfile.mkdtemp(prefix="mrd-", dir="/tmp")  # short: an ipc:// path must fit a unix socket address
    (Path(run) / "token").write_text(token)
    tagged = subprocess.Popen(["sleep", "600"], env={**os.environ, "MIRAGE_SESSION": session})
    stranger = subprocess.Popen(["sleep", "600"], env={k: v for k, v in os.environ.items() if k != "MIRAGE_SESSION"})
    # a stand-in for the session: it starts the daemon, then is SIGKILLed
    starter = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); "
         "print(p.pid, flush=True); time.sleep(600)",
         sys.executable, "-m", "emulator", "--run-dir", run, "--session", session, "--token-file",
         str(Path(run) / "token")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=open(Path(run) / "daemon.log", "wb"), text=True,
    )
    ctx = zmq.Context()
    try:
        daemon = psutil.Process(int(starter.stdout.readline()))
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoints(run)[0])
        for i, pid in enumerate([tagged.pid, stranger.pid]):
            sock.send(s.encode(s.Hello(token=token, req=i + 1, rank=i, pid=pid)))
            assert sock.poll(15_000) and isinstance(s.decode(sock.recv()), s.Ok)
        starter.kill()
        starter.wait()
        daemon.wait(15)
        all_gone([tagged.pid])
        assert tagged.wait(5) == -signal.SIGTERM
        assert stranger.poll() is None  # named in a Hello, but not of this session: left alone
        assert "the session went away; stopped 1 of its rank process(es)" in (Path(run) / "daemon.log").read_text()
    finally:
        for p in (tagged, stranger, starter):
            p.kill()
            p.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(run, ignore_errors=True)
