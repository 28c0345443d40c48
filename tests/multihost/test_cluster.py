"""The multihost harness itself: a Slurm cluster of network-namespace hosts on one machine.

These check what mirage's multihost tests will stand on: each srun task runs on its own
"host" (namespace, address, hostname) with the SLURM_* variables a real cluster gives, hosts
reach each other over TCP, salloc/sbatch work, and teardown leaves nothing behind.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster import Cluster, list_namespaces, namespace_pids, reap_stale

pytestmark = pytest.mark.multihost

PY = sys.executable

# One JSON line per task: where it runs and what Slurm told it.
_PROBE = r"""
import json, os, socket, subprocess
ns = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True, text=True).stdout.strip()
addrs = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True).stdout.split()
keys = ["SLURM_NODEID", "SLURM_PROCID", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURMD_NODENAME",
        "SLURM_JOB_ID", "SLURM_STEP_NODELIST"]
print(json.dumps({"ns": ns, "hostname": socket.gethostname(), "addr": addrs[3].split("/")[0] if len(addrs) > 3 else None,
                  "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}), flush=True)
"""


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _free_port() -> int:
    # any port: every namespace has its own; vary it so a TIME_WAIT of an earlier test never matters
    return 20000 + (os.getpid() * 7 + int(time.monotonic() * 1000)) % 20000


def test_all_hosts_idle(cluster):
    assert cluster.node_states() == {"h1": "idle", "h2": "idle"}
    assert cluster.nodes == ["h1", "h2"]
    assert len(set(cluster.ns.values())) == 2 and set(cluster.ns.values()) <= set(list_namespaces())


def test_srun_tasks_run_on_their_own_hosts(cluster):
    r = cluster.srun([PY, "-c", _PROBE], timeout=60)
    assert r.returncode == 0, r.stderr
    tasks = sorted(_lines(r.stdout), key=lambda t: int(t["SLURM_NODEID"]))
    assert len(tasks) == 2, r.stdout
    job_ids = {t["SLURM_JOB_ID"] for t in tasks}
    assert len(job_ids) == 1
    for i, (t, node) in enumerate(zip(tasks, ["h1", "h2"])):
        assert t["ns"] == cluster.ns[node], t
        assert t["hostname"] == node, t
        assert t["addr"] == cluster.addr[node], t
        assert t["SLURMD_NODENAME"] == node, t
        assert t["SLURM_NODEID"] == str(i) and t["SLURM_PROCID"] == str(i), t
        assert t["SLURM_NNODES"] == "2" and t["SLURM_NTASKS"] == "2", t
        assert t["SLURM_JOB_NODELIST"] == "h[1-2]" and t["SLURM_STEP_NODELIST"] == "h[1-2]", t


def test_srun_on_one_named_host(cluster):
    r = cluster.srun([PY, "-c", _PROBE], nodes=1, extra=["-w", "h2"], timeout=60)
    assert r.returncode == 0, r.stderr
    (t,) = _lines(r.stdout)
    assert (t["ns"], t["SLURMD_NODENAME"], t["SLURM_NNODES"], t["SLURM_JOB_NODELIST"]) == (cluster.ns["h2"], "h2",
                                                                                           "1", "h2")


def test_tcp_from_host2_to_host1(cluster):
    """Outside Slurm: a server in h1's namespace, a client in h2's, over the bridge."""
    port = _free_port()
    server = cluster.popen([PY, "-c", (
        "import socket, sys\n"
        f"s = socket.create_server(({cluster.addr['h1']!r}, {port}))\n"
        "print('ready', flush=True)\n"
        "c, _ = s.accept(); c.sendall(c.recv(100).upper() + b' from ' + socket.gethostname().encode()); c.close()\n"
    )], ns=cluster.ns["h1"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        r = cluster.on_host("h2", [PY, "-c", (
            "import socket\n"
            f"c = socket.create_connection(({cluster.addr['h1']!r}, {port}), timeout=10)\n"
            "c.sendall(b'hello'); print(c.recv(100).decode())\n")], timeout=30)
        assert r.returncode == 0, r.stderr
        # the server's namespace has no UTS namespace of its own (not under slurmd): any hostname
        assert r.stdout.startswith("HELLO from"), r.stdout
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_tcp_between_srun_tasks(cluster):
    """Under srun, as torchrun's c10d rendezvous will: node 0 listens, node 1 dials node 0's address."""
    port = _free_port()
    script = (
        "import os, socket, time\n"
        f"port = {port}\n"
        "if os.environ['SLURM_NODEID'] == '0':\n"
        "    s = socket.create_server(('0.0.0.0', port))\n"
        "    s.settimeout(30)\n"
        "    c, peer = s.accept()\n"
        "    print('node0 got', c.recv(100).decode(), 'from', peer[0], flush=True)\n"
        "else:\n"
        "    for _ in range(200):\n"
        "        try:\n"
        "            c = socket.create_connection((os.environ['MH_RDZV_ADDR'], port), timeout=5); break\n"
        "        except OSError:\n"
        "            time.sleep(0.05)\n"
        "    c.sendall(('hi from ' + os.environ['SLURMD_NODENAME']).encode()); c.close()\n"
    )
    r = cluster.srun([PY, "-c", script], env={"MH_RDZV_ADDR": cluster.addr["h1"]}, timeout=90)
    assert r.returncode == 0, r.stderr
    assert f"node0 got hi from h2 from {cluster.addr['h2']}" in r.stdout


def test_salloc_and_sbatch(cluster, tmp_path):
    r = cluster.salloc('echo "alloc $SLURM_NNODES $SLURM_JOB_NODELIST"; srun hostname | sort | tr "\\n" " "',
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "alloc 2 h[1-2]" in r.stdout and "h1 h2" in r.stdout, r.stdout
    out = tmp_path / "sbatch.out"
    r = cluster.run(["sbatch", "-N", "2", "--wait", "-o", out, "--wrap", "srun hostname | sort"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert out.read_text().split() == ["h1", "h2"]


def test_kill_host_leaves_the_others_running(multihost_ready):
    with Cluster(2) as c:
        assert namespace_pids(c.ns["h2"])
        c.kill_host("h2")
        assert namespace_pids(c.ns["h2"]) == []
        r = c.srun(["hostname"], nodes=1, extra=["-w", "h1"], timeout=60)
        assert (r.returncode, r.stdout.strip()) == (0, "h1"), r.stderr


def test_teardown_leaves_nothing(multihost_ready):
    c = Cluster(2)
    c.start()
    job = c.popen(["srun", "-N", "2", "sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a step running on both hosts: slurmstepd + sleep on each
            on_hosts = [namespace_pids(c.ns[n]) for n in c.nodes]
            if all(len(p) >= 3 for p in on_hosts):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the job step did not start on both hosts: {on_hosts}\n{c.diagnostics()}")
        pids = set(c.pids()) | {job.pid}
        namespaces = [c.head_ns, *c.ns.values()]
    finally:
        c.stop()
    print(f"2-host cluster: start {c.timings['start']:.2f}s, stop (with a running step) {c.timings['stop']:.2f}s")
    assert job.wait(timeout=10) is not None
    assert not set(namespaces) & set(list_namespaces())
    assert not [p for p in pids if _alive(p)], [(p, _cmd(p)) for p in pids if _alive(p)]
    assert not c.dir.exists()
    c.stop()  # twice is fine
    assert not c.dir.exists()


def test_reap_stale_after_the_owner_was_killed(multihost_ready):
    """A test process killed with SIGKILL leaves its cluster; the next run's fixture reaps it."""
    owner = subprocess.Popen(
        [PY, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); from cluster import Cluster\n"
                   "c = Cluster(1).start(); print(c.id, *c.pids(), flush=True); time.sleep(600)",
         os.path.dirname(os.path.abspath(__file__))], stdout=subprocess.PIPE, text=True)
    try:
        cid, *pids = owner.stdout.readline().split()
        assert cid, "the cluster did not start"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    reap_stale()  # (another xdist worker's fixture may reap it first: either way it must be gone)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"mh-{cid}-")]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [p for p in map(int, pids) if _alive(p)]:
        time.sleep(0.1)
    assert not [p for p in map(int, pids) if _alive(p)], [(p, _cmd(int(p))) for p in pids]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return "?"
