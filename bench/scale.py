"""How many emulated GPUs one machine holds: the DDP demo and a collectives smoke at N GPUs.

    python bench/scale.py --gpus 16 32 64              # the runs at nice 10, the sampler ahead of them
    python bench/scale.py --gpus 16 --workloads smoke --no-gloo      # one quick point

For every GPU count N and workload it runs, one after the other:

- **mirage**: ``mirage run --num-nodes N/G --gpus-per-node G --nproc-per-node G -- python FIXTURE``
  (G = ``--gpus-per-node``, 8 as on an MI350X node; ``--launch torchrun`` starts one torchrun
  per node instead, ``torchrun --nnodes=$WORLD_SIZE --node_rank=$RANK ...``, as the demo does);
- **fresh** (``--fork-server off`` or ``both``): the same with ``mirage run --fork-server off``, every rank
  a fresh interpreter (``mirage`` rows: ranks forked from the session's fork server, the default);
- **gloo** (unless ``--no-gloo``): the same fixture on plain CPU torch, ``torchrun --standalone
  --nproc_per_node=N FIXTURE`` with the fixture's gloo/cpu switches, no mirage anywhere.

Workloads: ``ddp`` is ``tests/fixtures/ml/ddp_mlp.py`` (``--steps`` steps; passes when it exits 0
and prints ``ddp_mlp_ok``, which it does only after an all_gather of every rank's weight checksum
found them identical and the loss dropped); ``smoke`` is ``tests/fixtures/ml/dist_smoke.py``
(init_process_group, one all_reduce checked exactly, destroy; ``dist_smoke_ok``).

Measured per run:

- wall: launch to exit;
- start-up: ``up``, launch to every rank's first line of its own (both fixtures print
  ``[rank R] ...`` once torch is imported; for both backends); ``reg``, launch to the last rank's
  first ``rank_registered`` event in the run's events.jsonl (the shim registers a rank once torch
  is imported and emulated), and per rank (reg / N); ``formed``: launch to the last
  ``comm_joined`` of the world communicator (init_process_group done everywhere);
- memory: the run's process tree sampled every ``--interval`` s with psutil: RSS of every
  process, and PSS / USS (private) from /proc/PID/smaps_rollup every ``--pss-every`` samples.
  Peaks of the sum over the ranks, of the whole tree, and the largest single rank; the bytes
  mirage's /dev/shm files of the run really hold (they are sparse);
- CPU: the daemon's and the session's CPU time (their last sample) and open fds, and every
  process of the run together (getrusage of reaped children, so nothing is missed between samples);
- the system: MemAvailable at its lowest during the run, and the load average before and after
  (the machine is shared: a figure taken under load says so).

Ratios compare mirage with gloo at the same world size (wall, start-up, CPU, memory per rank).
Nothing here asserts a time: benchmarks print figures.

Safety on a shared machine: the runs are niced (``--nice``, default 10; the bench itself stays 5
steps less nice, or 64 ranks on 2 cores would starve its sampling and its memory watch). If
MemAvailable falls under ``--min-avail-gib`` (default 3) during a run it stops the run the way
Ctrl-C would (SIGINT to mirage, whose teardown stops every node), then SIGKILLs whatever of the
run's tree is left, and records the run as "stopped: memory"; a run is skipped when MemAvailable
cannot cover the floor plus ``--need-mib-per-rank`` per rank to begin with. After every run it
checks that no process of the run is left (and kills any it finds, saying so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = {"ddp": ROOT / "tests/fixtures/ml/ddp_mlp.py", "smoke": ROOT / "tests/fixtures/ml/dist_smoke.py"}
OK_LINE = {"ddp": "ddp_mlp_ok", "smoke": "dist_smoke_ok"}
#: the fixtures' switches to plain CPU torch with gloo
GLOO_ENV = {
    "ddp": {"DDP_MLP_BACKEND": "gloo", "DDP_MLP_DEVICE": "cpu"},
    "smoke": {"DIST_SMOKE_BACKEND": "gloo", "DIST_SMOKE_DEVICE": "cpu"},
}
MIB = 1024 * 1024
#: a fixture's own line (both print "[rank R] ..." first thing after import torch / set_device)
RANK_LINE = re.compile(r"\[rank (\d+)\]")


def mirage_exe() -> str:
    here = Path(sys.executable).parent / "mirage"
    return str(here) if here.exists() else "mirage"


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def shm_bytes(session: str) -> int:
    """What a mirage session's files in /dev/shm (arenas, rings) really hold (they are sparse)."""
    prefix = f"mirage-{session}-"
    out = 0
    try:
        with os.scandir("/dev/shm") as it:
            for e in it:
                if e.name.startswith(prefix):
                    try:
                        out += e.stat().st_blocks * 512
                    except OSError:
                        pass
    except OSError:
        pass
    return out


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass
class Sample:
    """Peaks over a run's samples."""

    ranks_rss: int = 0  # sum over rank processes
    ranks_pss: int = 0
    ranks_uss: int = 0
    tree_rss: int = 0  # every process of the run
    tree_pss: int = 0
    rank_rss_max: int = 0  # the largest single rank
    rank_pss_max: int = 0
    rank_uss_max: int = 0
    daemon_rss: int = 0
    daemon_cpu: float = 0.0
    daemon_fds: int = 0
    session_rss: int = 0
    session_cpu: float = 0.0  # the `mirage run` process: events, output of every rank
    session_fds: int = 0
    threads: int = 0  # every thread of the run at once
    shm: int = 0  # bytes in this run's /dev/shm files (mirage's arenas and rings)
    samples: int = 0
    agents_rss: int = 0  # torchrun agents (if any)
    min_avail: int = 1 << 62
    nranks_seen: int = 0
    pids: set = field(default_factory=set)


@dataclass
class Result:
    backend: str
    workload: str
    gpus: int
    rc: int | None = None
    passed: bool = False
    note: str = ""
    wall: float = 0.0
    startup: float | None = None
    formed: float | None = None
    cpu_total: float = 0.0
    load_before: str = ""
    load_after: str = ""
    up: float | None = None  # launch → every rank printed its first line
    mem: Sample = field(default_factory=Sample)
    run_dir: str = ""


def classify(p: psutil.Process, fixture: str, root_pid: int, fork_server: bool = False) -> str:
    try:
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    joined = " ".join(cmd)
    if p.pid == root_pid:
        return "session"
    if "forkserver.server" in joined:  # the fork server, and the ranks it forked (which keep its cmdline)
        try:
            return "rank" if "forkserver.server" in " ".join(p.parent().cmdline()) else "forkserver"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
            return "gone"
    if "-m emulator" in joined:
        return "daemon"
    if "torchrun" in joined or "torch.distributed.run" in joined:
        return "agent"
    if any(c.endswith(fixture) for c in cmd):
        return "stub" if fork_server else "rank"  # with a fork server: what the launcher started, waiting
    return "other"


class Watch:
    """Samples a run's process tree until it ends; stops it if the machine runs short of memory."""

    def __init__(self, proc: subprocess.Popen, fixture: str, args, fork_server: bool = False):
        self.proc = proc
        self.fixture = fixture
        self.fork_server = fork_server  # the ranks are the fork server's children, their stubs wait
        self.args = args
        self.s = Sample()
        self.kinds: dict[int, str] = {}
        self.procs: dict[int, psutil.Process] = {}
        self.stopped = ""
        self.lock = threading.Lock()
        self.session = ""  # the mirage session's id, from the daemon's command line

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            kids = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = [root] + kids
        for p in out:
            if p.pid not in self.procs:
                self.procs[p.pid] = p
        return out

    def sample(self, full: bool) -> None:
        s = self.s
        ranks_rss = ranks_pss = ranks_uss = tree_rss = tree_pss = agents = 0
        nranks = threads = 0
        for p in self.tree():
            kind = self.kinds.get(p.pid)
            if kind is None or kind == "other":  # a rank's cmdline is final only after exec
                kind = self.kinds[p.pid] = classify(p, self.fixture, self.proc.pid, self.fork_server)
                if kind == "daemon" and not self.session:
                    try:
                        cmd = p.cmdline()
                        self.session = cmd[cmd.index("--session") + 1]
                    except (psutil.Error, ValueError, IndexError):
                        pass
            s.pids.add(p.pid)
            try:
                if full:
                    m = p.memory_full_info()
                    pss, uss = m.pss, m.uss
                else:
                    m = p.memory_info()
                    pss = uss = 0
                rss = m.rss
                threads += p.num_threads()
                if kind in ("daemon", "session"):
                    t = p.cpu_times()
                    fds = p.num_fds()
                    if kind == "daemon":
                        s.daemon_cpu = max(s.daemon_cpu, t.user + t.system)
                        s.daemon_fds = max(s.daemon_fds, fds)
                    else:
                        s.session_cpu = max(s.session_cpu, t.user + t.system)
                        s.session_fds = max(s.session_fds, fds)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            tree_rss += rss
            tree_pss += pss
            if kind == "rank":
                nranks += 1
                ranks_rss += rss
                ranks_pss += pss
                ranks_uss += uss
                s.rank_rss_max = max(s.rank_rss_max, rss)
                s.rank_pss_max = max(s.rank_pss_max, pss)
                s.rank_uss_max = max(s.rank_uss_max, uss)
            elif kind == "daemon":
                s.daemon_rss = max(s.daemon_rss, rss)
            elif kind == "session":
                s.session_rss = max(s.session_rss, rss)
            elif kind == "agent":
                agents += rss
        s.ranks_rss = max(s.ranks_rss, ranks_rss)
        s.ranks_pss = max(s.ranks_pss, ranks_pss)
        s.ranks_uss = max(s.ranks_uss, ranks_uss)
        s.tree_rss = max(s.tree_rss, tree_rss)
        s.tree_pss = max(s.tree_pss, tree_pss)
        s.agents_rss = max(s.agents_rss, agents)
        s.nranks_seen = max(s.nranks_seen, nranks)
        s.threads = max(s.threads, threads)
        s.samples += 1
        if self.session:
            s.shm = max(s.shm, shm_bytes(self.session))

    def stop(self, why: str) -> None:
        """Ctrl-C as a user would, then SIGKILL whatever of the tree is left (soon, when memory runs short)."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = why
        print(f"    !! stopping the run: {why}", flush=True)
        self.tree()  # know every pid before the tree comes apart
        try:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=3 if why.startswith("memory") else 15)
        except subprocess.TimeoutExpired:
            pass
        self.kill_leftovers()

    def kill_leftovers(self) -> list[int]:
        left = []
        for pid, p in list(self.procs.items()):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        return left

    def guard(self, deadline: float, done: threading.Event) -> None:
        """Watch MemAvailable and the clock at a fixed pace, whatever sampling a large tree costs."""
        floor = self.args.min_avail_gib * 1024 ** 3
        while not done.is_set() and self.proc.poll() is None:
            avail = mem_available()
            self.s.min_avail = min(self.s.min_avail, avail)
            if avail < floor:
                self.stop(f"memory: MemAvailable {avail / 1024 ** 3:.1f} GiB < {self.args.min_avail_gib} GiB")
                return
            if time.monotonic() > deadline:
                self.stop(f"timeout: over {self.args.timeout} s")
                return
            done.wait(0.25)

    def run(self, deadline: float) -> None:
        done = threading.Event()
        guard = threading.Thread(target=self.guard, args=(deadline, done), daemon=True)
        guard.start()
        n = 0
        try:
            while self.proc.poll() is None and not self.stopped:
                self.sample(full=n % self.args.pss_every == 0)
                n += 1
                time.sleep(self.args.interval)
        finally:
            done.set()
            guard.join()


def command(backend: str, workload: str, gpus: int, args) -> tuple[list[str], dict]:
    fixture = str(FIXTURES[workload].relative_to(ROOT))
    env = dict(os.environ, STEPS=str(args.steps))
    if backend == "gloo":
        env.update(GLOO_ENV[workload])
        for k in [k for k in env if k.startswith("MIRAGE_")]:
            del env[k]
        return ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                 fixture], env)
    g = min(args.gpus_per_node, gpus)
    if gpus % g:
        raise SystemExit(f"--gpus {gpus} is not a multiple of --gpus-per-node {g}")
    nodes = gpus // g
    topo = [mirage_exe(), "run", "--num-nodes", str(nodes), "--gpus-per-node", str(g),
            "--fork-server", "off" if backend == "fresh" else "on"]
    if args.hang_timeout:
        topo += ["--hang-timeout", str(args.hang_timeout)]
    if args.launch == "mirage":
        return topo + ["--nproc-per-node", str(g), "--", sys.executable, fixture], env
    if nodes == 1:
        return topo + ["--", "torchrun", "--standalone", f"--nproc_per_node={g}", fixture], env
    sh = ("exec torchrun --nnodes=$WORLD_SIZE --node_rank=$RANK "
          f"--nproc_per_node={g} --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT {fixture}")
    return topo + ["--", "sh", "-c", sh], env


def events_times(run_dir: str, gpus: int, t0: float) -> tuple[float | None, float | None]:
    """(launch → every rank registered, launch → every rank joined a communicator of size gpus)."""
    path = os.path.join(run_dir, "events.jsonl")
    registered: dict[int, float] = {}
    joined: dict[int, float] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("type") == "rank_registered":
                    registered.setdefault(e["rank"], e["t"])
                elif e.get("type") == "comm_joined" and e.get("size") == gpus:
                    joined.setdefault(e.get("global_rank", e.get("rank")), e["t"])
    except OSError:
        return None, None
    startup = max(registered.values()) - t0 if len(registered) >= gpus else None
    formed = max(joined.values()) - t0 if len(joined) >= gpus else None
    return startup, formed


def run_one(backend: str, workload: str, gpus: int, args) -> Result:
    r = Result(backend, workload, gpus)
    cmd, env = command(backend, workload, gpus, args)
    avail = mem_available()
    if avail < args.min_avail_gib * 1024 ** 3 + args.need_mib_per_rank * MIB * gpus:
        r.note = f"skipped: MemAvailable {avail / 1024 ** 3:.1f} GiB before the run"
        return r
    r.load_before = loadavg()
    print(f"--> {backend} {workload} {gpus} GPUs (load {r.load_before}): {' '.join(cmd)}", flush=True)
    with tempfile.NamedTemporaryFile("w+", prefix=f"scale-{backend}-{workload}-{gpus}-", suffix=".log",
                                     delete=not args.keep_logs) as log:
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        m0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, args.run_nice))
        first_line: dict[int, float] = {}  # rank -> when its first own line came out

        def pump() -> None:
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                log.write(line)
                m = RANK_LINE.search(line)
                if m:
                    first_line.setdefault(int(m.group(1)), time.time())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        w = Watch(proc, FIXTURES[workload].name, args, fork_server=backend == "mirage")
        try:
            w.run(m0 + args.timeout)
        except KeyboardInterrupt:
            w.stop("interrupted")
            raise
        finally:
            r.rc = proc.wait()
            r.wall = time.monotonic() - m0
            reader.join(timeout=30)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            r.cpu_total = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            time.sleep(0.5)  # let the teardown's last SIGKILLs land before looking for leftovers
            left = w.kill_leftovers()
            if left:
                print(f"    !! {len(left)} process(es) of the run were left and killed: {left[:8]}", flush=True)
        r.load_after = loadavg()
        log.flush()
        if len(first_line) >= gpus:
            r.up = max(first_line.values()) - t0
        r.mem = w.s
        log.seek(0)
        out = log.read()
        if args.keep_logs:
            print(f"    log: {log.name}")
    m = re.search(r"run dir: (\S+)", out)
    if m:
        r.run_dir = m.group(1)
        r.startup, r.formed = events_times(r.run_dir, gpus, t0)
    r.passed = r.rc == 0 and OK_LINE[workload] in out and not w.stopped
    r.note = w.stopped or ("" if r.passed else f"exit {r.rc}" + ("" if OK_LINE[workload] in out
                                                                 else f", no {OK_LINE[workload]}"))
    if not r.passed:
        tail = [ln for ln in out.splitlines() if ln.strip()][-6:]
        print("    " + "\n    ".join(tail), flush=True)
    return r


def mib(n: int) -> str:
    return f"{n / MIB:.0f}" if n else "-"


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[Result]) -> None:
    print("\ntime (s; up: launch to every rank's first line; reg: to every rank registered with the daemon;"
          " formed: to init_process_group done everywhere; cpu: every process of the run)")
    print(f"{'backend':7} {'work':5} {'GPUs':>4} {'ok':>3} {'wall':>6} {'up':>6} {'reg':>6} {'s/rank':>6} "
          f"{'formed':>6} {'cpu':>6} {'cpu/rk':>6}  {'load before':>15} -> {'after':<15}")
    for r in results:
        per = r.startup / r.gpus if r.startup else None
        print(f"{r.backend:7} {r.workload:5} {r.gpus:>4} {'yes' if r.passed else 'NO':>3} {r.wall:>6.1f} "
              f"{fmt(r.up):>6} {fmt(r.startup):>6} {fmt(per, '.2f'):>6} {fmt(r.formed):>6} {r.cpu_total:>6.1f} "
              f"{r.cpu_total / r.gpus:>6.2f}  {r.load_before:>15} -> {r.load_after:<15}"
              + (f" [{r.note}]" if r.note else ""))
    print("\nmemory (MiB; rank: the largest rank; ranks, tree: peak of the sum over the rank processes, over"
          " every process; shm: mirage's /dev/shm files; dmn, ses: the daemon, the `mirage run` process (gloo:"
          " torchrun's agent); every: the sampling period achieved)")
    print(f"{'backend':7} {'work':5} {'GPUs':>4} | {'rank RSS':>8} {'PSS':>4} {'USS':>4} | {'ranks PSS':>9} "
          f"{'tree PSS':>8} {'tree RSS':>8} {'shm':>5} | {'dmn RSS':>7} {'cpu s':>5} {'fds':>4} | "
          f"{'ses RSS':>7} {'cpu s':>5} {'fds':>4} | {'threads':>7} {'min avail':>9} {'every':>5}")
    for r in results:
        s = r.mem
        dmn = bool(s.daemon_rss)
        print(f"{r.backend:7} {r.workload:5} {r.gpus:>4} | {mib(s.rank_rss_max):>8} {mib(s.rank_pss_max):>4} "
              f"{mib(s.rank_uss_max):>4} | {mib(s.ranks_pss):>9} {mib(s.tree_pss):>8} {mib(s.tree_rss):>8} "
              f"{mib(s.shm):>5} | {mib(s.daemon_rss):>7} {fmt(s.daemon_cpu if dmn else None):>5} "
              f"{(s.daemon_fds if dmn else '-'):>4} | {mib(s.session_rss):>7} "
              f"{fmt(s.session_cpu if dmn else None):>5} {(s.session_fds if dmn else '-'):>4} | {s.threads:>7} "
              f"{(s.min_avail / 1024 ** 3 if s.min_avail < 1 << 60 else 0):>8.1f}G "
              f"{(r.wall / s.samples if s.samples else 0):>4.1f}s")


def ratios(results: list[Result]) -> None:
    by = {(r.backend, r.workload, r.gpus): r for r in results}
    lines = []
    for r in results:
        if r.backend == "gloo":
            continue
        g = by.get(("gloo", r.workload, r.gpus))
        if not g or not (r.passed and g.passed):
            continue
        pss_m = r.mem.tree_pss / r.gpus
        pss_g = g.mem.tree_pss / g.gpus
        up = f"{r.up / g.up:5.2f}x" if r.up and g.up else "    -"
        lines.append(f"{r.backend:6} {r.workload:5} {r.gpus:>4}  wall {r.wall / g.wall:5.2f}x   up {up}   "
                     f"cpu {r.cpu_total / g.cpu_total:5.2f}x   "
                     f"PSS per GPU {pss_m / MIB:4.0f} vs {pss_g / MIB:4.0f} MiB ({pss_m / pss_g:4.2f}x)")
    if lines:
        print("\nmirage / gloo at the same world size (> 1: mirage needs more):")
        print("\n".join(lines))
    ok = [r for r in results if r.backend != "gloo" and r.passed and r.mem.tree_pss]
    if ok:
        print("\nper emulated GPU (whole run's PSS peak / GPUs; daemon + session included):")
        for r in ok:
            print(f"  {r.backend:6} {r.workload:5} {r.gpus:>4} GPUs: {r.mem.tree_pss / r.gpus / MIB:6.0f} MiB  "
                  f"(largest rank PSS {r.mem.rank_pss_max / MIB:.0f}, USS {r.mem.rank_uss_max / MIB:.0f}; "
                  f"daemon RSS {r.mem.daemon_rss / MIB:.0f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--workloads", nargs="+", choices=sorted(FIXTURES), default=["ddp", "smoke"])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--launch", choices=["mirage", "torchrun"], default="mirage",
                    help="who starts the ranks under mirage: mirage (--nproc-per-node) or a torchrun per node")
    ap.add_argument("--fork-server", choices=["on", "off", "both"], default="on",
                    help="mirage's ranks forked from its fork server (on; 'mirage' in the tables), fresh "
                    "interpreters (off; 'fresh'), or both, one after the other")
    ap.add_argument("--no-gloo", dest="gloo", action="store_false", help="skip the plain CPU torch + gloo runs")
    ap.add_argument("--steps", type=int, default=50, help="DDP steps (default 50, as the demo)")
    ap.add_argument("--timeout", type=float, default=900, help="stop a run after this many seconds")
    ap.add_argument("--hang-timeout", type=float, default=0,
                    help="mirage --hang-timeout (default: mirage's own)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--pss-every", type=int, default=4, help="read PSS/USS every this many samples")
    ap.add_argument("--min-avail-gib", type=float, default=3.0,
                    help="stop a run when MemAvailable falls under this (the machine is shared)")
    ap.add_argument("--need-mib-per-rank", type=int, default=150,
                    help="skip a run unless MemAvailable covers the floor plus this per rank")
    ap.add_argument("--nice", type=int, default=10,
                    help="run mirage and gloo at least this nice (the machine is shared); the bench itself "
                         "stays 5 steps less nice, so that its sampling keeps up")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args()

    own = os.getpriority(os.PRIO_PROCESS, 0)
    # The runs are niced (the machine is shared); the sampler stays 5 steps ahead of them, or with
    # 64 ranks on 2 cores it would get 1/65 of a core and sample every few seconds, missing peaks.
    args.run_nice = min(19, max(args.nice, own + 5))
    print(f"machine: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 1024 ** 3:.1f} GiB, "
          f"MemAvailable {mem_available() / 1024 ** 3:.1f} GiB, load {loadavg()}; "
          f"runs at nice {args.run_nice}, the sampler at {own}", flush=True)
    results = []
    try:
        for gpus in args.gpus:
            for workload in args.workloads:
                mirages = {"on": ["mirage"], "off": ["fresh"], "both": ["mirage", "fresh"]}[args.fork_server]
                for backend in mirages + (["gloo"] if args.gloo else []):
                    r = run_one(backend, workload, gpus, args)
                    results.append(r)
                    print(f"    {'pass' if r.passed else 'FAIL'}: wall {r.wall:.1f} s, start-up "
                          f"{fmt(r.startup)} s, tree PSS {mib(r.mem.tree_pss)} MiB, load after "
                          f"{r.load_after} {r.note}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    table(results)
    ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**{k: v for k, v in vars(r).items() if k != "mem"},
                        "mem": {k: v for k, v in vars(r.mem).items() if k != "pids"}} for r in results], f, indent=1)
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
