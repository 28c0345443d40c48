"""mirage over several hosts: ``mirage run --launcher slurm`` inside an allocation of the namespace cluster.

Each test runs mirage as a user would on a login node (the head namespace, which is
not one of the allocation's hosts): ``salloc -N 2`` then ``mirage run --launcher slurm``,
which starts one agent per host with srun. The ranks on h1 and h2 reach the head's
daemon over TCP (CURVE), their output, stacks and ends reach the head's session.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import Cluster, namespace_pids

pytestmark = pytest.mark.multihost

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
DDP = REPO / "tests" / "fixtures" / "ml" / "ddp_mlp.py"
FSDP_TP = REPO / "tests" / "fixtures" / "ml" / "fsdp_tp_2d.py"
SUBGROUP_HANG = REPO / "tests" / "fixtures" / "ml" / "subgroup_hang.py"
XHOST = REPO / "tests" / "fixtures" / "ml" / "xhost_allreduce.py"
XCOLL = REPO / "tests" / "fixtures" / "ml" / "xhost_collectives.py"
# pytorch/examples' FSDP x TP program, unmodified (it asks for 4 GPUs on the machine it runs on)
FSDP_TP_EXAMPLE = REPO / "tests" / "fixtures" / "frameworks" / "examples" / "tensor_parallelism" / "fsdp_tp_example.py"
ENV = {"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
LOSS = re.compile(r"loss: (\S+) -> (\S+) over")
#: all-reduces of any size go host daemon to host daemon (by default only those from 256 KiB)
ACROSS_FROM_ANY_SIZE = "MIRAGE_ACROSS_HOSTS_MIN_BYTES=0"


def _mirage(log_dir: Path, *args: str, env: str = "", gpus: int = 2) -> str:
    """The salloc script that runs ``mirage run --launcher slurm`` over both hosts."""
    return (f"cd {REPO} && {env} mirage run --launcher slurm --log-dir {log_dir} "
            f"--gpus-per-node {gpus} {' '.join(args)}")


def _run_dir(log_dir: Path) -> Path:
    (run,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return run


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.endswith("}")]


def _training(c: Cluster, log_dir: Path) -> dict:
    """Wait until the run in ``log_dir`` trains on both hosts; its session.json."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = [p for p in log_dir.iterdir() if p.is_dir()] if log_dir.exists() else []
        if runs and (runs[0] / "events.jsonl").exists() and sum(
                e["type"] == "coll_completed" for e in _events(runs[0])) > 20:
            return json.loads((runs[0] / "session.json").read_text())
        time.sleep(0.2)
    pytest.fail(f"the run did not get going on both hosts\n{c.diagnostics()}")


def _ours_left(c: Cluster, session: str) -> list[str]:
    """Processes of this run still alive in any of the cluster's namespaces."""
    left = []
    for ns in [c.head_ns, *c.ns.values()]:
        for pid in namespace_pids(ns):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"MIRAGE_SESSION={session}".encode() in env.split(b"\0"):
                left.append(f"{ns}: {pid} {cmd}")
    return left


def _daemon_bytes(log: Path) -> tuple[int, int, int]:
    """A daemon's data, from its log's last line: socket-transport bytes received from ranks, peer bytes sent to and
    received from other hosts' daemons."""
    m = re.search(r"socket payload bytes received: (\d+); peer bytes sent: (\d+), received: (\d+)", log.read_text())
    assert m, log.read_text()[-2000:]
    return int(m[1]), int(m[2]), int(m[3])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b""


@pytest.fixture(scope="module")
def gloo_loss():
    """The loss line of the same program on 4 CPU ranks with gloo (torchrun, no mirage)."""
    env = dict(os.environ, DDP_MLP_BACKEND="gloo", DDP_MLP_DEVICE="cpu", OMP_NUM_THREADS="1")
    for _ in range(3):
        r = subprocess.run([str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node=4", str(DDP)],
                           capture_output=True, text=True, timeout=300, env=env)
        # Plain CPU torch with gloo sometimes aborts at exit, after the training and its checks are done
        # ("terminate called without an active exception", twice in a row in one CI run): what it
        # computed is still the reference.
        done = "ddp_mlp_ok" in r.stdout and LOSS.search(r.stdout)
        if r.returncode == 0 or done and "terminate called without an active exception" in r.stderr:
            break
    assert "ddp_mlp_ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return LOSS.search(r.stdout).groups()


def test_ddp_over_two_hosts_matches_gloo(cluster, tmp_path, gloo_loss):
    # its 21 KB gradient bucket is under the size that goes host daemon to host daemon by default: 0 sends it there
    r = cluster.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(DDP),
                               env=ACROSS_FROM_ANY_SIZE), nodes=2, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "all ranks converged with identical replicas" in out and "ddp_mlp_ok" in out
    assert LOSS.search(out).groups() == gloo_loss  # what 4 CPU ranks with gloo compute, to the digit
    run = _run_dir(tmp_path)
    events = _events(run)
    hosts = {e["rank"]: e["host"] for e in events if e["type"] == "rank_registered"}
    assert hosts == {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
    transports = {e["transport"] for e in events if e["type"] == "comm_joined"}
    assert transports == {"socket"}  # NET/Socket to the head's daemon, over TCP
    # its gradients' all-reduces (and its start's broadcasts and all-gathers) went host daemon to host daemon, the
    # head's daemon keeping the books
    across = {e["op"] for e in events if e["type"] == "coll_enqueued" and e["transport"] == "hosts"}
    assert across == {"allreduce", "broadcast", "allgather"}, across
    session = json.loads((run / "session.json").read_text())["session"]
    for rank, host in hosts.items():
        assert "training on cuda" in (run / f"rank-{rank}.log").read_text()
        # each host keeps its ranks' own files too
        assert Path(f"/tmp/mirage-{os.getuid()}/agent-{session}-{host}/ranks/rank-{rank}.stdout").exists()
    assert not (run / "curve.secret").exists() and not (run / "token").exists()
    assert _ours_left(cluster, session) == []


def test_all_reduces_across_hosts_go_host_daemon_to_host_daemon(cluster, tmp_path):
    # the world (2 ranks per host) and a pair of ranks on different hosts, results checked against gloo's
    # every size, 1 element up, across hosts (odd sizes cut into uneven segments)
    r = cluster.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(XHOST), env=ACROSS_FROM_ANY_SIZE),
                       nodes=2, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "xhost_allreduce_ok" in out and out.count("all-reduces equal gloo's") == 4, out[-6000:]
    run = _run_dir(tmp_path)
    events = _events(run)
    per_rank = 41  # the fixture's all-reduces on each group
    comms = {}
    for e in events:
        if e["type"] == "coll_enqueued" and e["transport"] == "hosts":
            assert e["op"] == "allreduce"
            comms.setdefault(e["comm"], []).append(e["rank"])
    assert sorted(sorted(ranks) for ranks in comms.values()) == [
        sorted([0, 1] * per_rank), sorted([0, 1, 2, 3] * per_rank)], comms.keys()
    # the head's daemon kept the books of every one of them (each completed once, for all its ranks)...
    completed = {(e["comm"], e["seq"]) for e in events if e["type"] == "coll_completed" and e["comm"] in comms}
    assert len(completed) >= 2 * per_rank
    # ...and carried none of their bytes: its ranks sent it no data at all (the groups' first collectives are barriers)
    assert _daemon_bytes(run / "daemon.log") == (0, 0, 0)
    session = json.loads((run / "session.json").read_text())["session"]
    logs = {h: Path(f"/tmp/mirage-{os.getuid()}/agent-{session}-{h}/daemon.log") for h in ("h1", "h2")}
    (_, sent1, got1), (_, sent2, got2) = _daemon_bytes(logs["h1"]), _daemon_bytes(logs["h2"])
    assert sent1 > 0 and sent1 == got2 and sent2 == got1, (sent1, got1, sent2, got2)  # what one sent, the other got
    assert _ours_left(cluster, session) == []


def _every_collective_across(c: Cluster, tmp_path: Path, hosts: int) -> None:
    """xhost_collectives.py on ``hosts`` hosts of 2 ranks: every result gloo's, no byte through the head."""
    r = c.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(XCOLL), env=ACROSS_FROM_ANY_SIZE),
                 nodes=hosts, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    ranks = 2 * hosts
    assert r.returncode == 0, out[-6000:]
    assert "xhost_collectives_ok" in out and out.count("collectives equal gloo's") == ranks, out[-6000:]
    assert out.count("FSDP2 losses") == ranks, out[-6000:]
    run = _run_dir(tmp_path)
    ops = {e["op"] for e in _events(run) if e["type"] == "coll_enqueued" and e["transport"] == "hosts"}
    assert ops == {"allgather", "reduce_scatter", "broadcast", "allreduce"}, ops
    # the head's daemon kept their books and carried none of their bytes (every first collective is a barrier)
    assert _daemon_bytes(run / "daemon.log") == (0, 0, 0)
    session = json.loads((run / "session.json").read_text())["session"]
    names = [f"h{k}" for k in range(1, hosts + 1)]
    moved = [_daemon_bytes(Path(f"/tmp/mirage-{os.getuid()}/agent-{session}-{h}/daemon.log"))[1:] for h in names]
    # what the host daemons sent, the others received
    assert all(sent > 0 for sent, _ in moved) and sum(s for s, _ in moved) == sum(g for _, g in moved), moved
    assert _ours_left(c, session) == []


def test_fsdp_and_every_collective_across_hosts_go_host_daemon_to_host_daemon(cluster, tmp_path):
    # all-gathers, reduce-scatters, broadcasts and averages over the world (2 ranks per host) and a pair across
    # the hosts, equal to gloo's on the same ranks; then FSDP2 over the world, equal to FSDP2 over gloo
    _every_collective_across(cluster, tmp_path, 2)


def test_every_collective_across_three_hosts(multihost_ready, tmp_path):
    # three hosts: pieces owned by, and partials sent to, more than one other host; broadcasts from every host
    with Cluster(3) as c:
        _every_collective_across(c, tmp_path, 3)


def test_a_slow_lossy_link_between_hosts_still_gives_gloo_s_results(multihost_ready, tmp_path):
    # netem is not in every kernel (this box's has none); tbf is: a rate limit whose short queue drops what overflows
    # it makes every host's link slow and lossy, and TCP retransmits. Nothing of mirage's may take that for a host
    # that died: every collective across hosts, and FSDP2, still equal gloo's, and nothing is left running.
    with Cluster(2) as c:
        for host in ("h1", "h2"):
            tbf = ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "40mbit", "burst", "16kb", "latency", "1ms"]
            r = c.on_host(host, tbf)
            assert r.returncode == 0, r.stderr
        r = c.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(XCOLL), env=ACROSS_FROM_ANY_SIZE),
                     nodes=2, timeout=300, env=ENV)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
        assert "xhost_collectives_ok" in out and out.count("collectives equal gloo's") == 4, out[-6000:]
        stats = c.on_host("h2", ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
        dropped = int(re.search(r"dropped (\d+)", stats)[1])
        assert dropped > 0, stats  # the link did lose packets
        session = json.loads((_run_dir(tmp_path) / "session.json").read_text())["session"]
        assert _ours_left(c, session) == []
        print(f"slow lossy link: {dropped} packets dropped on h2's link")


def test_torchrun_rendezvous_crosses_hosts_clocked(cluster, tmp_path, gloo_loss):
    # a Slurm user's line: torchrun on each host, c10d rendezvous at the first host (MASTER_ADDR)
    torchrun = (f"torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-id mirage "
                f"--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT {DDP}")
    r = cluster.salloc(_mirage(tmp_path, "--exec-mode clocked", "--", "bash", "-c", f"'{torchrun}'"), nodes=2,
                       timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "ddp_mlp_ok" in out and LOSS.search(out).groups() == gloo_loss  # the clock changes no result
    run = _run_dir(tmp_path)
    hosts = {e["rank"]: e["host"] for e in _events(run) if e["type"] == "rank_registered"}
    assert sorted(hosts) == [0, 1, 2, 3] and set(hosts.values()) == {"h1", "h2"}
    assert "predicted step" in r.stderr
    # every host's ranks' traces came to the head, and the merged trace has all four
    assert sorted(p.name for p in (run / "traces").iterdir()) == [f"rank-{r}.json" for r in range(4)]
    assert json.loads((run / "trace.json").read_text())["mirage"]["ranks"] == [0, 1, 2, 3]


def test_a_hang_on_host_2_is_reported_from_the_head(cluster, tmp_path):
    r = cluster.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--hang-timeout 3",
                               "--inject rank=3,seq=5,action=hang", "--", "python", str(DDP)),
                       nodes=2, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 124, out[-6000:]
    assert "missing ranks {3 on h2}" in out
    assert re.search(r"process \d+ on h2: sleeping", out), out[-6000:]
    assert re.search(rf'now at: File "{re.escape(str(DDP))}", line \d+ in main', out), out[-6000:]
    (report,) = json.loads((_run_dir(tmp_path) / "hang-report.json").read_text())
    assert report["ranks"]["3"]["host"] == "h2" and "ddp_mlp.py" in report["ranks"]["3"]["stacks"]
    session = json.loads((_run_dir(tmp_path) / "session.json").read_text())["session"]
    assert _ours_left(cluster, session) == []


def test_a_mesh_s_groups_inside_a_host_use_its_own_daemon(cluster, tmp_path):
    # FSDP over "dp" (across the hosts), tensor parallel over "tp" (inside each): the tp groups' collectives
    # go through their host's daemon over shared memory, the dp groups' through the head's over TCP
    # (clocked: each host's daemon times its own collectives, on the same profile as the head's)
    r = cluster.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--exec-mode clocked", "--", "python", str(FSDP_TP)),
                       nodes=2, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "fsdp_tp_2d_ok" in out  # losses and weights match an unsharded model trained on one device
    assert "predicted step" in r.stderr
    events = _events(_run_dir(tmp_path))
    members: dict[str, set[int]] = {}
    for e in events:
        if e["type"] == "comm_joined":
            members.setdefault((e["comm"], e["transport"]), set()).add(e["global_rank"])
    groups = sorted((sorted(ranks), transport) for (_, transport), ranks in members.items())
    assert ([0, 1], "shm") in groups and ([2, 3], "shm") in groups, groups  # tp: inside h1, inside h2
    assert ([0, 2], "socket") in groups and ([1, 3], "socket") in groups, groups  # dp: across the hosts
    shm = {comm for (comm, transport) in members if transport == "shm"}
    # every host's collectives are in the head's journal, from the hosts' daemons
    done = {e["comm"] for e in events if e["type"] == "coll_completed"}
    assert shm <= done
    session = json.loads((_run_dir(tmp_path) / "session.json").read_text())["session"]
    for host in ("h1", "h2"):
        agent_dir = Path(f"/tmp/mirage-{os.getuid()}/agent-{session}-{host}")
        assert "serving ipc://" in (agent_dir / "daemon.log").read_text()
        assert agent_dir.stat().st_mode & 0o777 == 0o700  # where that daemon's sockets are
        assert not (agent_dir / "token").exists()
    assert _ours_left(cluster, session) == []


def test_pytorch_s_fsdp_tp_example_over_two_hosts(cluster, tmp_path):
    r = cluster.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(FSDP_TP_EXAMPLE), gpus=4),
                       nodes=2, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "[0] " in out and "2D training successfully completed!" in out, out[-6000:]
    joined = {(e["comm"], e["transport"]) for e in _events(_run_dir(tmp_path)) if e["type"] == "comm_joined"}
    assert {t for _, t in joined} == {"shm", "socket"}  # its tp pairs inside each host, the rest across


def test_a_hang_inside_host_2_is_reported_from_the_head(cluster, tmp_path):
    # ranks 2 and 3 share a group that only h2's daemon sees: its hang detector finds rank 3 missing
    r = cluster.salloc(_mirage(tmp_path, "--nproc-per-node 2", "--hang-timeout 3", "--", "python",
                               str(SUBGROUP_HANG)), nodes=2, timeout=300, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 124, out[-6000:]
    assert "missing ranks {3 on h2}" in out, out[-6000:]
    assert re.search(r"process \d+ on h2: sleeping", out), out[-6000:]
    (report,) = json.loads((_run_dir(tmp_path) / "hang-report.json").read_text())
    assert report["ranks"]["3"]["host"] == "h2" and "subgroup_hang.py" in report["ranks"]["3"]["stacks"]
    hangs = [e for e in _events(_run_dir(tmp_path)) if e["type"] == "hang"]
    assert [(e["joined"], e["missing"]) for e in hangs] == [([2], [3])]
    session = json.loads((_run_dir(tmp_path) / "session.json").read_text())["session"]
    assert _ours_left(cluster, session) == []


def test_a_killed_host_ends_the_run_naming_it(multihost_ready, tmp_path):
    with Cluster(2) as c:
        job = c.popen(["salloc", "-N", "2", "bash", "-c",
                       _mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(DDP), env="STEPS=1000000")],
                      env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            session = _training(c, tmp_path)["session"]
            c.kill_host("h2")
            killed = time.monotonic()
            out, err = job.communicate(timeout=60)
            took = time.monotonic() - killed
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode != 0
        assert took < 15, f"the run took {took:.1f} s to end after its host died"
        assert "host h2 was lost" in err and "ranks {2, 3}" in err, err[-4000:]
        run = _run_dir(tmp_path)
        lost = [e for e in _events(run) if e["type"] == "host_lost"]
        assert [(e["host"], e["nodes"], e["ranks"]) for e in lost] == [("h2", [1], [2, 3])]
        report = json.loads((run / "report.json").read_text())
        assert report["returncode"] == job.returncode and "host h2 was lost" in report["summary"]
        assert _ours_left(c, session) == []  # nothing of the run on h1 or the head
        for rank in (0, 1):  # the surviving host's logs are kept
            assert Path(f"/tmp/mirage-{os.getuid()}/agent-{session}-h1/ranks/rank-{rank}.stdout").exists()
            assert "training on cuda" in (run / f"rank-{rank}.log").read_text()
        print(f"killed host: the run ended {took:.1f} s after h2 died")


def test_a_host_whose_link_goes_down_mid_collective_is_reported_by_name(multihost_ready, tmp_path):
    # DDP's gradient all-reduces go host daemon to host daemon; h2's only link to everyone goes down under them
    with Cluster(2) as c:
        job = c.popen(["salloc", "-N", "2", "bash", "-c",
                       _mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(DDP),
                               env=f"STEPS=1000000 {ACROSS_FROM_ANY_SIZE}")],
                      env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            session = _training(c, tmp_path)["session"]
            assert c.on_host("h2", ["ip", "link", "set", "eth0", "down"]).returncode == 0
            out, err = job.communicate(timeout=60)
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode != 0
        assert "host h2 was lost" in err and "ranks {2, 3}" in err, err[-4000:]
        lost = [e for e in _events(_run_dir(tmp_path)) if e["type"] == "host_lost"]
        assert [(e["host"], e["ranks"]) for e in lost] == [("h2", [2, 3])]
        deadline = time.monotonic() + 15  # h2's agent, cut off from the head, stops its own after its silence rule
        while _ours_left(c, session) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ours_left(c, session) == []


def test_exec_on_each_host_then_ctrl_c_on_the_head_stops_every_host(cluster, tmp_path):
    job = cluster.popen(["salloc", "-N", "2", "bash", "-c",
                         _mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(DDP), env="STEPS=1000000")],
                        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        session = _training(cluster, tmp_path)
        # a probe in each node's environment, on that node's host (through srun, inside the job)
        probe = ("import socket, torch; print('probe', socket.gethostname(), torch.cuda.device_count(), "
                 "torch.cuda.get_device_name(0))")
        for node, host in ((0, "h1"), (1, "h2")):
            r = cluster.run(["mirage", "exec", session["session"], "--node", str(node), "--", "python", "-c", probe],
                            env=ENV, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            assert f"probe {host} 2 AMD Instinct MI350X" in r.stdout, r.stdout + r.stderr
        os.kill(session["pid"], signal.SIGINT)  # what Ctrl-C in mirage's terminal sends it
        stopped = time.monotonic()
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if job.poll() is None:
            job.kill()
    assert "exit 130" in err, err[-3000:]
    assert _ours_left(cluster, session["session"]) == []
    print(f"Ctrl-C: every host stopped within {took:.1f} s")


def test_a_host_s_daemon_that_dies_fails_that_host_s_ranks_naming_it(cluster, tmp_path):
    job = cluster.popen(["salloc", "-N", "2", "bash", "-c",
                         _mirage(tmp_path, "--nproc-per-node 2", "--", "python", str(FSDP_TP), env="STEPS=1000000")],
                        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        session = _training(cluster, tmp_path)["session"]
        (daemon,) = [pid for pid in namespace_pids(cluster.ns["h2"])
                     if re.search(rb"-m\0emulator\0.*agent-" + session.encode() + b"-h2", _cmdline(pid))]
        os.kill(daemon, signal.SIGKILL)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode not in (0, None), err[-3000:]
    run = _run_dir(tmp_path)
    assert f"mirage node h2: this host's daemon (pid {daemon}) exited" in (run / "node-1.log").read_text()
    ranks = (run / "rank-2.log").read_text() + (run / "rank-3.log").read_text()
    assert f"the emulator daemon (pid {daemon}) is gone" in ranks, ranks[-3000:]
    assert _ours_left(cluster, session) == []
