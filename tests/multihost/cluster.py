"""A small Slurm cluster on one machine: hosts are network namespaces.

The test harness for running mirage over several hosts (issue #17) without several
machines. A :class:`Cluster` builds, all of it private to the instance:

* a *head* network namespace ``mh-<id>-head`` holding a bridge ``br0`` (10.213.0.1/24 by
  default) and running ``slurmctld``; it is the "login node": :meth:`Cluster.run` runs
  ``srun``/``salloc``/``sbatch`` in it;
* one namespace ``mh-<id>-hN`` per host, joined to the bridge by a veth pair (``eth0`` on
  the host side, 10.213.0.(10+N)/24), loopback up, running ``slurmd -N hN`` in a UTS
  namespace of its own whose hostname is ``hN`` (so ``srun hostname`` prints ``h1``, ``h2``);
* one ``munged`` with a key made for the cluster, its socket in the cluster's temp dir
  (``AuthInfo=socket=...``); Unix sockets are reached by path, so every namespace uses it;
* a generated ``slurm.conf`` in the temp dir (``SLURM_CONF`` points at it).

Nothing is added to the root network namespace: the bridge and every veth live inside the
cluster's namespaces, so two clusters (two xdist workers) never clash, not on names, not on
addresses, not on ports, and the machine's own firewall rules do not see the traffic.

Teardown (:meth:`Cluster.stop`) kills every process in the cluster's namespaces (slurmd,
slurmstepd, job steps, srun, slurmctld) and munged, deletes the namespaces (which deletes
the veths and the bridge) and the temp dir. It is idempotent, runs from ``__exit__`` and at
interpreter exit, and :func:`reap_stale` removes what a killed test process left behind.

Stdlib only; needs root, ``ip netns`` (iproute2), ``unshare`` (util-linux) and Debian's
``slurm-wlm`` and ``munge`` (:func:`ensure_installed` installs those two).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

#: Binaries a cluster needs, by the package that brings them.
SLURM_BINARIES = ("slurmctld", "slurmd", "srun", "salloc", "sbatch", "sinfo", "squeue", "scontrol")
MUNGE_BINARIES = ("munged", "munge")
TOOLS = ("ip", "unshare", "nsenter", "mount")

#: Every namespace a cluster makes is named ``mh-<6 hex digits>-<head|hN>``.
NS_PREFIX = "mh-"
_NS_RE = re.compile(r"^mh-([0-9a-f]{6})-(head|h\d+)$")
#: Each cluster's temp dir is ``<root>/mh-<id>``; short, for the munge socket's path. As root, under
#: /run: munged refuses a seed or socket folder whose parents anyone may write without the sticky bit,
#: and a machine's /tmp is not always 1777.
_TMP_ROOT = Path("/run/mirage-multihost") if os.geteuid() == 0 and os.path.isdir("/run") else Path(tempfile.gettempdir())


# ---------------------------------------------------------------- availability


def _sh(args, *, check=True, timeout=30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, timeout=timeout, capture_output=True, text=True, **kw)


def missing_binaries() -> list[str]:
    return [b for b in (*TOOLS, *SLURM_BINARIES, *MUNGE_BINARIES) if shutil.which(b) is None]


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here (a pytest skip reason), or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "multihost: needs root (network namespaces, slurmd)"
    if shutil.which("ip") is None:
        return "multihost: needs `ip` (iproute2) for network namespaces"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    try:
        r = _sh(["ip", "netns", "add", probe], check=False)
        if r.returncode != 0:
            return f"multihost: `ip netns add` does not work here: {r.stderr.strip()}"
    finally:
        _sh(["ip", "netns", "delete", probe], check=False)
    missing = missing_binaries()
    if missing:
        return f"multihost: missing {', '.join(missing)} (apt-get install slurm-wlm munge)"
    return None


def ensure_installed(*, quiet: bool = True) -> str | None:
    """Install ``slurm-wlm`` and ``munge`` with apt-get if their binaries are missing.

    Only as root and where apt-get exists; serialised across processes by a file lock (two
    xdist workers may both ask). Services the packages would start are kept from starting
    (a temporary ``/usr/sbin/policy-rc.d`` where none exists) and any that did start are
    stopped. Returns None when everything is there, else why not (for a skip).
    """
    if not [b for b in (*SLURM_BINARIES, *MUNGE_BINARIES) if shutil.which(b) is None]:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"multihost: missing {', '.join(missing_binaries())}; install slurm-wlm and munge (needs root + apt)"
    _TMP_ROOT.mkdir(mode=0o755, exist_ok=True)
    with open(_TMP_ROOT / "mirage-multihost-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if [b for b in (*SLURM_BINARIES, *MUNGE_BINARIES) if shutil.which(b) is None]:
            _apt_install(["slurm-wlm", "munge"], quiet=quiet)
            stop_system_services()
    missing = missing_binaries()
    return f"multihost: apt-get did not provide {', '.join(missing)}" if missing else None


def _apt_install(packages, *, quiet):
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():  # no service start during the install (invoke-rc.d asks this file)
        policy.write_text("#!/bin/sh\n# mirage tests/multihost: no service starts during apt-get\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    out = subprocess.DEVNULL if quiet else None
    try:
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
        if subprocess.run(cmd, env=env, stdout=out, stderr=out, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, stdout=out, stderr=out, timeout=600)
            subprocess.run(cmd, env=env, stdout=out, stderr=out, timeout=900)
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)


def stop_system_services():
    """Stop and disable the munge/slurmd/slurmctld services a package install may have started.

    The cluster runs daemons of its own; the system's would hold the default ports and
    socket. Under systemd: ``systemctl disable --now``; otherwise ``service X stop`` for those
    whose pid file names a live process.
    """
    services = ("slurmd", "slurmctld", "munge")
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        _sh(["systemctl", "disable", "--now", *services], check=False, timeout=60)
        return
    pidfiles = {"munge": "/run/munge/munged.pid", "slurmd": "/run/slurmd.pid", "slurmctld": "/run/slurmctld.pid"}
    for svc in services:
        pid = _read_pid(pidfiles[svc])
        if pid and _alive(pid):
            if shutil.which("service"):
                _sh(["service", svc, "stop"], check=False, timeout=60)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def _read_pid(path) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------- namespaces


def list_namespaces() -> list[str]:
    """Every network namespace that a Cluster made (``mh-<id>-...``), any cluster."""
    r = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line and _NS_RE.match(line.split()[0])]


def namespace_pids(ns: str) -> list[int]:
    r = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_namespaces(namespaces, *, grace: float = 3.0):
    """SIGTERM every process in the namespaces, then SIGKILL what is left after ``grace`` s.

    ``grace=0``: SIGKILL at once. Processes are found by their network namespace, so a
    job step that left its session or process group is found too; the SIGKILL round repeats
    while the namespaces still hold processes (one may have forked while we listed).
    """
    rounds = [(signal.SIGTERM, grace)] if grace > 0 else []
    rounds += [(signal.SIGKILL, 5.0)] * 3
    for sig, wait in rounds:
        pids = [p for ns in namespaces for p in namespace_pids(ns)]
        if not pids:
            return
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)


def reap_stale() -> list[str]:
    """Tear down clusters whose owning process died without tearing down (e.g. SIGKILL).

    A cluster's temp dir holds ``owner`` (the pid that built it); a namespace ``mh-<id>-*``
    whose owner is gone, or has no temp dir, is reaped. Returns the namespaces removed.
    """
    removed = []
    by_id: dict[str, list[str]] = {}
    for ns in list_namespaces():
        by_id.setdefault(_NS_RE.match(ns).group(1), []).append(ns)
    for cid, namespaces in by_id.items():
        tmp = _TMP_ROOT / f"mh-{cid}"
        owner = _read_pid(tmp / "owner")
        if owner and _alive(owner):
            continue
        _kill_namespaces(namespaces, grace=1.0)
        munged = _read_pid(tmp / "munged.pid")
        if munged and _alive(munged) and str(tmp) in _cmdline(munged):
            os.kill(munged, signal.SIGTERM)
        for ns in namespaces:
            _sh(["ip", "netns", "delete", ns], check=False)
            removed.append(ns)
        shutil.rmtree(tmp, ignore_errors=True)
    return removed


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------- the cluster


class ClusterError(RuntimeError):
    pass


class Cluster:
    """``hosts`` Slurm nodes ``h1..hN``, each a network namespace; see the module docstring.

    Use as a context manager (``with Cluster(2) as c: c.srun(...)``) or call
    :meth:`start` / :meth:`stop`. After :meth:`start`:

    * ``nodes``: ``["h1", "h2", ...]``; ``addr[node]``: its IP; ``ns[node]``: its namespace;
    * ``head_ns``, ``head_addr``: the head namespace (slurmctld, srun) and its bridge address;
    * ``conf``: the slurm.conf; ``env``: os.environ plus ``SLURM_CONF``;
    * ``timings``: seconds ``start`` and ``stop`` took, and the parts of ``start``: ``network``
      (namespaces, bridge, veths), ``munge`` (munged up) and ``slurm`` (daemons up, nodes idle).
    """

    SLURMCTLD_PORT = 6817  # the defaults: each namespace has its own ports, so never taken
    SLURMD_PORT = 6818

    def __init__(self, hosts: int = 2, *, cpus: int = 1, subnet: str = "10.213.0", start_timeout: float = 60.0):
        if not 1 <= hosts <= 200:
            raise ValueError("hosts must be 1..200")
        self.id = secrets.token_hex(3)
        self.cpus = cpus
        self.start_timeout = start_timeout
        self.nodes = [f"h{i}" for i in range(1, hosts + 1)]
        self.head_ns = f"{NS_PREFIX}{self.id}-head"
        self.ns = {n: f"{NS_PREFIX}{self.id}-{n}" for n in self.nodes}
        self.head_addr = f"{subnet}.1"
        self.addr = {n: f"{subnet}.{10 + i}" for i, n in enumerate(self.nodes, 1)}
        self.dir = _TMP_ROOT / f"mh-{self.id}"
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.sock"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.timings: dict[str, float] = {}
        self._procs: list[subprocess.Popen] = []
        self._names: dict[int, str] = {}
        self._logs: list = []
        self._made_ns: list[str] = []
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> Cluster:
        if self._started:
            return self
        self._started = True
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            _TMP_ROOT.mkdir(mode=0o755, exist_ok=True)
            self.dir.mkdir(mode=0o755)
            self.dir.chmod(0o755)  # munged wants every directory on its socket's path searchable by all
            (self.dir / "owner").write_text(f"{os.getpid()}\n")
            self._network()
            self.timings["network"] = time.monotonic() - t0
            self._munge()
            self.timings["munge"] = time.monotonic() - t0 - self.timings["network"]
            self._write_conf()
            self._slurmctld()
            for node in self.nodes:
                self._slurmd(node)
            self._wait_idle()
            self.timings["slurm"] = time.monotonic() - t0 - self.timings["network"] - self.timings["munge"]
        except Exception as e:
            diag = self.diagnostics()
            self.stop()
            raise ClusterError(f"cluster {self.id} did not start: {e}\n{diag}") from None
        except BaseException:  # KeyboardInterrupt, pytest's timeout: tear down, pass it on
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - t0
        return self

    def stop(self):
        """Kill everything the cluster runs and delete what it made. Safe to call twice."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        t0 = time.monotonic()
        # hosts first (slurmd, slurmstepd, tasks), then the head (srun, salloc, slurmctld)
        # (slurmctld can take seconds to finish on SIGTERM; its state dies with the temp dir anyway)
        _kill_namespaces([self.ns[n] for n in self.nodes if self.ns[n] in self._made_ns], grace=2.0)
        _kill_namespaces([self.head_ns] if self.head_ns in self._made_ns else [], grace=0.5)
        for p in self._procs:  # munged, and reap the daemons we started
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for f in self._logs:
            f.close()
        for ns in reversed(self._made_ns):  # deleting a namespace deletes its veth end and bridge
            _sh(["ip", "netns", "delete", ns], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        self.timings["stop"] = time.monotonic() - t0

    # ------------------------------------------------------------ building

    def _ip(self, *args, ns: str | None = None):
        cmd = ["ip", *(["-n", ns] if ns else []), *args]
        r = _sh(cmd, check=False)
        if r.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def _network(self):
        for ns in (self.head_ns, *self.ns.values()):
            self._ip("netns", "add", ns)
            self._made_ns.append(ns)
            self._ip("link", "set", "lo", "up", ns=ns)
        self._ip("link", "add", "br0", "type", "bridge", ns=self.head_ns)
        self._ip("addr", "add", f"{self.head_addr}/24", "dev", "br0", ns=self.head_ns)
        self._ip("link", "set", "br0", "up", ns=self.head_ns)
        for node in self.nodes:
            # both ends made straight inside their namespaces: no name in the root namespace
            self._ip("link", "add", "name", f"v{node}", "netns", self.head_ns, "type", "veth",
                     "peer", "name", "eth0", "netns", self.ns[node])
            self._ip("link", "set", f"v{node}", "master", "br0", "up", ns=self.head_ns)
            self._ip("addr", "add", f"{self.addr[node]}/24", "dev", "eth0", ns=self.ns[node])
            self._ip("link", "set", "eth0", "up", ns=self.ns[node])

    def _spawn(self, args, log_name) -> subprocess.Popen:
        log = open(self.dir / log_name, "ab")
        self._logs.append(log)
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             env=self.env, start_new_session=True)
        self._procs.append(p)
        self._names[p.pid] = log_name.removesuffix(".out")
        return p

    def _munge(self):
        key = self.dir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        d = self.dir
        self._spawn(["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
                     f"--log-file={d / 'munged.log'}", "--num-threads=2"], "munged.out")
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket")

    def _write_conf(self):
        d = self.dir
        # the cluster's names, as a real cluster's DNS gives them (torchrun's c10d rendezvous resolves
        # its own hostname to decide whether it hosts the store)
        names = ["127.0.0.1 localhost", f"{self.head_addr} head", *(f"{a} {n}" for n, a in self.addr.items())]
        (d / "hosts").write_text("\n".join(names) + "\n")
        (d / "hosts").chmod(0o644)
        for node in self.nodes:
            (d / node).mkdir(mode=0o755)
        (d / "ctld").mkdir(mode=0o755)
        lines = [
            "# generated by tests/multihost/cluster.py",
            f"ClusterName=mh{self.id}",
            f"SlurmctldHost=head({self.head_addr})",
            f"SlurmctldPort={self.SLURMCTLD_PORT}",
            f"SlurmdPort={self.SLURMD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmctldPidFile={d / 'ctld' / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / 'ctld' / 'slurmctld.log'}",
            f"SlurmdSpoolDir={d}/%n",
            f"SlurmdPidFile={d}/%n/slurmd.pid",
            f"SlurmdLogFile={d}/%n/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # short timeouts: a test that kills a host wants to hear of it within seconds
            "SlurmdTimeout=30",
            "SlurmctldTimeout=30",
            "MessageTimeout=10",
            "KillWait=2",
            "InactiveLimit=0",
            "MinJobAge=30",
            "Waittime=0",
            "TreeWidth=50",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={node} NodeAddr={self.addr[node]} "
                         f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # slurmd and srun look for plugstack.conf and cgroup.conf next to slurm.conf
        (d / "plugstack.conf").write_text("")

    def _in_ns(self, ns: str, hostname: str, args) -> list[str]:
        """Run ``args`` in network namespace ``ns`` as a host named ``hostname``.

        Like ``ip netns exec`` (a mount namespace with a sysfs of the network namespace, so
        /sys/class/net lists the host's own interfaces) but keeping /sys/fs/cgroup, which
        ``ip netns exec``'s fresh sysfs hides and slurmd needs ("Unable to initialize cgroup
        plugin"); in a UTS namespace of its own whose hostname is ``hostname``.
        """
        mnt = self.dir / "cgroup"  # a mount point used only inside the private mount namespace
        mnt.mkdir(exist_ok=True)
        script = ('mount --rbind /sys/fs/cgroup "$1" && mount -t sysfs "$2" /sys && '
                  'mount --move "$1" /sys/fs/cgroup && mount --bind "$3" /etc/hosts && hostname "$2" && '
                  'shift 3 && exec "$@"')
        # nsenter, unshare and sh each exec the next: the pid stays the daemon's
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private",
                "--", "sh", "-c", script, "sh", str(mnt), hostname, str(self.dir / "hosts"), *args]

    def _slurmctld(self):
        self._spawn(self._in_ns(self.head_ns, "head", ["slurmctld", "-D", "-i", "-f", str(self.conf)]),
                    "slurmctld.out")

    def _slurmd(self, node: str):
        self._spawn(self._in_ns(self.ns[node], node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)]),
                    f"slurmd-{node}.out")

    def _wait(self, ok, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            for p in self._procs:
                if p.poll() is not None:
                    raise ClusterError(f"{self._names.get(p.pid, p.args)} exited ({p.returncode}) "
                                       f"while waiting for {what}")
            time.sleep(0.1)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")

    def node_states(self) -> dict[str, str]:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=15)
        if r.returncode != 0:
            return {}
        return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)

    def _wait_idle(self):
        self._wait(lambda: (s := self.node_states()) and all(s.get(n) == "idle" for n in self.nodes),
                   self.start_timeout, "every node idle in sinfo")

    # ------------------------------------------------------------ using it

    def run(self, args, *, timeout: float = 120, check: bool = False, input: str | None = None,
            env: dict | None = None, ns: str | None = None) -> subprocess.CompletedProcess:
        """Run ``args`` (``srun``, ``salloc``, ``sbatch``, ``sinfo``...) on the head, text output.

        ``ns`` names another namespace to run in (default: the head's); ``env`` adds variables
        to the cluster's environment (which has ``SLURM_CONF``).
        """
        cmd = ["ip", "netns", "exec", ns or self.head_ns, *map(str, args)]
        full_env = dict(self.env, **(env or {}))
        return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout,
                              check=check, env=full_env, stdin=None if input is not None else subprocess.DEVNULL)

    def popen(self, args, *, env: dict | None = None, ns: str | None = None, **kw) -> subprocess.Popen:
        """Start ``args`` on the head (or in ``ns``) in the background, e.g. a long ``srun``."""
        cmd = ["ip", "netns", "exec", ns or self.head_ns, *map(str, args)]
        return subprocess.Popen(cmd, env=dict(self.env, **(env or {})), **kw)

    def srun(self, args, *, nodes: int | None = None, ntasks: int | None = None, extra=(), **kw):
        """``srun -N nodes [-n ntasks] extra... args`` on the head (one task per node by default)."""
        nodes = len(self.nodes) if nodes is None else nodes
        opts = ["-N", str(nodes), "-n", str(ntasks or nodes), *extra]
        return self.run(["srun", *opts, *args], **kw)

    def salloc(self, script: str, *, nodes: int | None = None, extra=(), **kw):
        """Run the bash ``script`` inside ``salloc -N nodes``: it sees SLURM_JOB_* and calls srun."""
        nodes = len(self.nodes) if nodes is None else nodes
        return self.run(["salloc", "-N", str(nodes), *extra, "bash", "-c", script], **kw)

    def on_host(self, node: str, args, **kw) -> subprocess.CompletedProcess:
        """Run ``args`` directly in ``node``'s namespace, outside Slurm."""
        return self.run(args, ns=self.ns[node], **kw)

    def kill_host(self, node: str):
        """SIGKILL everything on ``node`` (slurmd, its job steps): the host dies, its network stays."""
        _kill_namespaces([self.ns[node]], grace=0.0)

    def pids(self) -> list[int]:
        """Every live process in the cluster's namespaces, plus munged."""
        pids = [p for ns in self._made_ns for p in namespace_pids(ns)]
        return pids + [p.pid for p in self._procs if p.poll() is None and p.pid not in pids]

    def diagnostics(self) -> str:
        """The tail of each daemon's log, for a failure message."""
        out = []
        for f in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*/*.log")):
            with contextlib.suppress(OSError):
                tail = f.read_text(errors="replace").splitlines()[-15:]
                out.append(f"--- {f.relative_to(self.dir)}\n" + "\n".join(tail))
        return "\n".join(out)


if __name__ == "__main__":  # python tests/multihost/cluster.py [hosts]: build, show, tear down
    import sys

    reason = unavailable_reason()
    if reason:
        sys.exit(reason)
    with Cluster(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as c:
        print(c.run(["sinfo"]).stdout, end="")
        print(c.srun(["hostname"]).stdout, end="")
    print(f"start {c.timings['start']:.2f}s, stop {c.timings['stop']:.2f}s")
