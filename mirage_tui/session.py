"""A session owns every process of one run: the daemon, the node processes, their children.

It creates the run directory, starts the daemon and waits until it answers,
starts one process per emulated node (or, with ``--nproc-per-node``, that many
rank processes per node, as torchrun would) with the environment the shim reads,
gathers every event (daemon events from ZeroMQ, output lines from the rank
files and node pipes) into one ordered stream that goes to ``events.jsonl``
and to the caller's sink, and tears everything down at the end: nodes first,
the daemon last, then anything still carrying the session's id.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import zmq

from emulator import faults
from emulator import kineto_trace
from emulator import schema as s
from emulator.arena import session_segments
from emulator.daemon import endpoints
from emulator.profiles import profile_path
from mirage_tui import diagnosis, flight_recorder, report, rundir, sessions
from mirage_tui.output import RankTail, pump_pipe
from mirage_tui.runstate import Outcome, RunState
from mirage_tui.topology import ExecMode, OnHang, Topology, UsageError, kept_env
from shim.bootstrap import is_torchrun_agent

#: How long the other nodes may keep running after one failed.
FAIL_GRACE_S = 3.0
#: How long a process gets between SIGTERM and SIGKILL.
TERM_GRACE_S = 3.0
DAEMON_START_TIMEOUT_S = 20.0
#: Exit code of a run stopped because of a hang (as coreutils' timeout uses).
HANG_EXIT = 124
#: Exit code of a run whose emulator daemon died under it (as ``docker run`` answers its daemon's failures).
DAEMON_DIED_EXIT = 125
#: Exit code of a run stopped because its run directory could not be written (sysexits' EX_IOERR).
WRITE_FAILED_EXIT = 74
#: Events queued for the journal at most: a rank flooding its output is read only as fast as it is recorded.
EVENT_BACKLOG = 20_000
#: Teardown waits for the event pumps and the journal as long as they make progress, and this long when they do not.
DRAIN_STALL_S = 10.0
_BOOT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim", "boot")

Sink = Callable[[s.Event], None]


class LaunchError(Exception):
    """The session could not start (command missing, daemon not answering)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not import or load anything
_PR_SET_PDEATHSIG = 1


def _die_with_session():
    """A pre-exec hook: the node gets SIGTERM from the kernel if this session dies, even by SIGKILL.

    Teardown covers every other ending; this covers the one where no code of ours runs. (Nodes that
    registered with the daemon are also stopped by it; this reaches nodes that never did.)
    """
    parent = os.getpid()

    def hook() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the session died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


@dataclass(frozen=True)
class Launched:
    """One process the session started: a node's command, or (``--nproc-per-node``) one rank of a node."""

    proc: subprocess.Popen
    node: int
    rank: int | None = None  # the global rank mirage gave it; None for a node process


class Session:
    """Run ``topology``'s command on its emulated cluster; events go to ``sink``."""

    def __init__(self, topology: Topology, sink: Sink):
        self.topology = topology
        self.sink = sink
        self.run = rundir.create(topology.log_dir, sockets=not topology.in_process)
        self.daemon: subprocess.Popen | None = None
        self.procs: list[Launched] = []  # every process started, in order: one per node, or one per rank
        # (event, its encoded line if we already have it) — daemon events arrive encoded
        self._events: queue.Queue[tuple[s.Event, bytes | None] | None] = queue.Queue(EVENT_BACKLOG)
        self._written = 0  # events the dispatcher has handled: teardown's measure of progress
        self.write_error: str | None = None  # set when the run directory could not be written
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._journal = open(self.run.events, "ab")
        self._log_files: dict[str, object] = {}
        self._dirty_logs: dict[str, object] = {}  # log files written since the last flush
        self._sink_errors: set[str] = set()  # display failures already reported
        self._exited: list[int] = []  # indexes into procs of the processes seen ended, in that order
        self._tearing_down = False
        self.state = RunState()  # the fold of every event (written by the dispatcher only): diagnoses, the report
        self._hangs: queue.Queue[s.HangDetected] = queue.Queue()
        self.trace: str | None = None  # the merged trace.json of a clocked run, once closed

    # ------------------------------------------------------------ events

    def emit(self, event: s.Event, line: bytes | None = None) -> None:
        """Queue an event for the journal and the sink (any thread); ``line`` is its encoding, if known."""
        self._events.put((event, line))

    def _dispatch(self) -> None:
        # the only writer of events.jsonl and the only caller of the sink
        while True:
            event = self._events.get()
            batch = [event]
            while True:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            for item in batch:
                if item is None:
                    self._flush_journal()
                    return
                e, line = item
                self._written += 1
                self._record(e, line)
                self.state.apply(e)
                if isinstance(e, s.HangDetected):
                    self._flush_journal()  # the diagnosis reads the journal (Flight Recorder dumps)
                    self._hangs.put(e)
                if self._tearing_down and isinstance(e, s.CommFailed):
                    continue  # ranks we are stopping take their communicators with them: not news
                try:
                    self.sink(e)
                except Exception as err:  # a broken display must not stop the journal
                    self._sink_failed(err)
            self._flush_journal()

    def _sink_failed(self, err: Exception) -> None:
        """Report a display failure once per kind (not once per event); a reader that went away is let go."""
        if isinstance(err, BrokenPipeError):  # e.g. `mirage run ... | head`: the run goes on, recorded
            self.sink = lambda event: None
            return
        key = f"{type(err).__name__}: {err}"
        if key not in self._sink_errors:
            self._sink_errors.add(key)
            traceback.print_exception(err)

    def _record(self, e: s.Event, line: bytes | None) -> None:
        """Write one event to the journal (and an output line to its log); a failed write stops the run."""
        if self.write_error is not None:
            return  # the run is being stopped; what could not be written is named in the summary
        try:
            self._journal.write((line or s.encode(e)) + b"\n")
        except (OSError, ValueError) as err:
            return self._write_failed(self.run.events, err)
        if isinstance(e, s.OutputLine):
            path = self.run.rank_log(e.rank) if e.rank >= 0 else self.run.node_log(e.node)
            try:
                self._log_line(e)
            except (OSError, ValueError) as err:
                self._write_failed(path, err)

    def _flush_journal(self) -> None:
        if self.write_error is None:
            try:
                self._journal.flush()
            except (OSError, ValueError) as err:
                self._write_failed(self.run.events, err)
        while self._dirty_logs and self.write_error is None:
            path, f = self._dirty_logs.popitem()
            try:
                f.flush()
            except (OSError, ValueError) as err:
                self._write_failed(path, err)

    def _write_failed(self, path: str, err: Exception) -> None:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        self.write_error = f"{path}: {why}"

    def _log_line(self, e: s.OutputLine) -> None:
        path = self.run.rank_log(e.rank) if e.rank >= 0 else self.run.node_log(e.node)
        f = self._log_files.get(path)
        if f is None:
            f = self._log_files[path] = open(path, "a", encoding="utf-8")
        f.write(e.text + "\n")
        self._dirty_logs[path] = f  # flushed with the journal, once per batch of events

    def _subscribe(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoints(self.run.path)[1])
        self._sub = sub

    def _pump_daemon_events(self) -> None:
        while True:
            stopping = self._stop.is_set()  # read before draining, so the last drain is complete
            if self._sub.poll(0 if stopping else 100):
                while True:
                    try:
                        data = self._sub.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for event, line in s.iter_events(data.split(b"\n")):
                        self.emit(event, line)
            if stopping:
                return

    def _pump_rank_files(self) -> None:
        tail = RankTail(self.run.ranks)
        while not self._stop.wait(0.05):
            for line in tail.poll():
                self.emit(line)
        while lines := tail.poll():  # everything written before the processes ended
            for line in lines:
                self.emit(line)
        for line in tail.poll(final=True):
            self.emit(line)

    def _thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # ------------------------------------------------------------ start

    def _start_daemon(self) -> None:
        topo = self.topology
        log = open(os.path.join(self.run.path, "daemon.log"), "ab")
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "emulator", "--run-dir", self.run.path, "--session", self.run.session,
             "--token-file", self.run.token_file, "--profile", topo.profile, "--nodes", str(topo.num_nodes),
             "--gpus-per-node", str(topo.gpus_per_node), "--hang-timeout", str(topo.hang_timeout_s),
             "--exec-mode", topo.exec_mode.value],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self._daemon_env(),
        )
        log.close()
        self._subscribe()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints(self.run.path)[0])
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        try:
            # ready once a ping is answered Ok AND its DaemonReady reached our SUB socket
            # (before that, ZeroMQ may drop events: the slow-joiner window)
            while time.monotonic() < deadline:
                if self.daemon.poll() is not None:
                    raise LaunchError(
                        f"the mirage daemon exited with code {self.daemon.returncode}; "
                        f"see {self.run.path}/daemon.log", 1,
                    )
                dealer.send(s.encode(s.Ping(token=self.run.token)))
                if not (dealer.poll(200) and isinstance(s.decode(dealer.recv()), s.Ok)):
                    continue
                while self._sub.poll(200):
                    for event in s.decode_events(self._sub.recv()):
                        if isinstance(event, s.DaemonReady):
                            self.emit(event)
                            return
            raise LaunchError(f"the mirage daemon did not answer within {DAEMON_START_TIMEOUT_S:.0f} s", 1)
        finally:
            dealer.close(0)

    def _daemon_env(self) -> dict[str, str]:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(_BOOT_DIR))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["MIRAGE_SESSION"] = self.run.session  # tags it for the orphan sweep
        return env

    def node_env(self, node: int, master_port: int) -> dict[str, str]:
        """The environment node process ``node`` starts with.

        One node is a machine's shell: no per-rank variables, so launchers that
        start their own ranks (Lightning, Accelerate, ``mp.spawn``) see what they
        would see there. Several nodes launched directly (one process per node)
        get ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` for ``env://``, as a job
        scheduler gives them. What the user exported passes through, as in a shell
        (with ``--clear-env-vars``, only :data:`~mirage_tui.topology.CLEARED_ENV_KEEPS`).
        """
        topo = self.topology
        if topo.clear_env:
            env = kept_env(dict(os.environ))
        else:
            env = {k: v for k, v in os.environ.items() if k != "MIRAGE_RANK_PID"}
        if topo.num_nodes > 1 and topo.nproc_per_node is None:
            env.update(RANK=str(node), WORLD_SIZE=str(topo.num_nodes), LOCAL_RANK="0")
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
            NCCL_HOSTID=f"mirage-node-{node}", PYTHONUNBUFFERED="1",
        )
        env.update(dict(topo.env))  # the user's --env wins over our defaults, not over MIRAGE_*
        env.update(
            MIRAGE_HEAD_ADDR="127.0.0.1", MIRAGE_HEAD_PORT=str(master_port),
            MIRAGE_SESSION=self.run.session, MIRAGE_RUN_DIR=self.run.path,
            MIRAGE_ENDPOINT=endpoints(self.run.path)[0], MIRAGE_TOKEN=self.run.token,
            # the profile's file, not its name: a rank whose environment lost XDG_CONFIG_HOME
            # (the user's --env, a launcher's) still loads the same user profile
            MIRAGE_PROFILE=str(profile_path(topo.profile).absolute()), MIRAGE_GPUS_PER_NODE=str(topo.gpus_per_node),
            MIRAGE_NODE_RANK=str(node), MIRAGE_NUM_NODES=str(topo.num_nodes),
        )
        if topo.in_process:
            env["MIRAGE_IN_PROCESS"] = "1"
        if topo.exec_mode is ExecMode.CLOCKED:
            env["MIRAGE_EXEC_MODE"] = topo.exec_mode.value
        if self.daemon is not None:  # ranks stop waiting for replies once it is gone
            env["MIRAGE_DAEMON_PID"] = str(self.daemon.pid)
        if topo.hbm_bytes is not None:
            env["MIRAGE_HBM_BYTES"] = str(topo.hbm_bytes)
        if topo.faults:
            env[faults.ENV] = ";".join(f.spec() for f in topo.faults)
        if topo.debug_rank is not None:  # that rank waits for a debugger before its program runs (shim.debugger)
            env["MIRAGE_DEBUG_RANK"] = str(topo.debug_rank)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_BOOT_DIR, env.get("PYTHONPATH")) if p)
        return env

    def rank_env(self, node: int, local_rank: int, master_port: int) -> dict[str, str]:
        """The environment of rank process ``local_rank`` of node ``node`` (``--nproc-per-node``).

        The node's environment plus what torchrun 2.13's agent gives each worker
        (``LocalElasticAgent._start_workers``), as a static rendezvous over all
        nodes would: one role, no restarts, no agent store (rank 0 hosts the
        ``env://`` store, there being no agent to host it). The per-rank
        variables win over ``--env``, as torchrun's do over the shell's.
        """
        topo = self.topology
        nproc = topo.nproc_per_node or 1
        rank, world = node * nproc + local_rank, topo.num_nodes * nproc
        env = self.node_env(node, master_port)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(topo.num_nodes),
            ROLE_RANK=str(rank), ROLE_NAME="default", ROLE_WORLD_SIZE=str(world),
            TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID=f"mirage-{self.run.session}", TORCHELASTIC_USE_AGENT_STORE="False",
        )
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers per node
        return env

    def _launch(self, node: int, rank: int | None, env: dict[str, str]) -> None:
        """Start the command as node ``node``'s process, or as its rank ``rank``; track it at once.

        A rank's stdout and stderr are its rank files from the start (the kernel writes them, as the
        shim's capture would), so a program that is not Python, or prints before the shim takes over,
        is still that rank's. A node's are pipes, read as ``[node<n>]`` lines.
        """
        topo = self.topology
        if rank is None:
            out: int = subprocess.PIPE
            err: int = subprocess.PIPE
        else:
            out, err = (os.open(os.path.join(self.run.ranks, f"rank-{rank}.{stream}"),
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for stream in ("stdout", "stderr"))
        try:
            proc = subprocess.Popen(
                list(topo.command), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                cwd=topo.workdir or None, start_new_session=True, preexec_fn=_die_with_session(),
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            what = "not found" if isinstance(e, FileNotFoundError) else "not executable"
            if topo.workdir and not os.path.isdir(topo.workdir):
                raise LaunchError(f"--workdir {topo.workdir}: no such directory", 2) from None
            raise LaunchError(f"command {what}: {topo.command[0]} (searched PATH)", 127) from None
        finally:
            if rank is not None:
                os.close(out)
                os.close(err)
        self.procs.append(Launched(proc, node, rank))
        if rank is None:
            self._threads.append(pump_pipe(proc.stdout, node, s.Stream.STDOUT, self.emit))
            self._threads.append(pump_pipe(proc.stderr, node, s.Stream.STDERR, self.emit))

    def start(self) -> None:
        """Start the daemon (unless in-process), the event pumps and the node processes."""
        try:  # so that 'mirage sessions' and 'mirage-tui --attach' find the run
            sessions.register(self.run.session, self.run.path, self.topology)
        except (OSError, UsageError) as e:
            print(f"mirage: this run is not listed in 'mirage sessions': {e}", file=sys.stderr)
        self._thread(self._dispatch, "dispatch")
        if not self.topology.in_process:
            self._start_daemon()
            self._thread(self._pump_daemon_events, "daemon-events")
        self._thread(self._pump_rank_files, "rank-output")
        port = _free_port()
        for node in range(self.topology.num_nodes):  # for 'mirage exec SESSION --node N'
            sessions.write_node_env(self.run.path, node, self.node_env(node, port))
        nproc = self.topology.nproc_per_node
        for node in range(self.topology.num_nodes):
            if nproc is None:
                self._launch(node, None, self.node_env(node, port))
                continue
            for local in range(nproc):
                self._launch(node, node * nproc + local, self.rank_env(node, local, port))

    # ------------------------------------------------------------ wait / stop

    def wait(self) -> Outcome:
        """Block until every process exited (or one failed and the rest were stopped)."""
        first_failure: tuple[int, int] | None = None
        failed_at = 0.0
        while True:
            running = 0
            if self.write_error is not None:  # the disk is full: stop now rather than lose output silently
                self._terminate_nodes()
                return Outcome(
                    WRITE_FAILED_EXIT,
                    f"could not write the run directory ({self.write_error}); the run was stopped so that "
                    f"no output is lost silently",
                    self.run.path,
                )
            # before the nodes: ranks fail fast once the daemon is gone, and its death is the cause
            if self.daemon is not None and self.daemon.poll() is not None and first_failure is None:
                first_failure, failed_at = (-1, self.daemon.returncode), time.monotonic()
            for i, launched in enumerate(self.procs):
                code = launched.proc.poll()
                if code is None:
                    running += 1
                    continue
                if self._note_exit(i) and code != 0 and first_failure is None:
                    first_failure, failed_at = (i, code), time.monotonic()
            if not running:
                break
            if first_failure and time.monotonic() - failed_at > FAIL_GRACE_S:
                self._terminate_nodes()
            hang = self._report_hangs()
            if hang is not None and self.topology.on_hang is OnHang.EXIT:
                self._terminate_nodes()
                return Outcome(HANG_EXIT, hang, self.run.path)
            time.sleep(0.05)
        if first_failure is None:
            kind = "node" if self.topology.nproc_per_node is None else "rank"
            return Outcome(0, f"all {len(self.procs)} {kind} process(es) exited 0", self.run.path)
        index, code = first_failure
        if index < 0:
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            return Outcome(
                DAEMON_DIED_EXIT,
                f"the mirage daemon (pid {self.daemon.pid}) {how} during the run; see {self.run.path}/daemon.log",
                self.run.path,
            )
        return Outcome(code if code > 0 else 128 - code, self._failure_summary(index, code), self.run.path)

    def _report_hangs(self) -> str | None:
        """Diagnose every hang the daemon reported since the last call; return a summary of the first."""
        summary = None
        while True:
            try:
                finding = self._hangs.get_nowait()
            except queue.Empty:
                return summary
            label = self.state.comm_label(finding.comm)
            d = diagnosis.diagnose(
                finding, dict(self.state.rank_pids), dict(self.state.last_output), self.run.ranks, self.run.session,
                label,
            )
            try:
                path = diagnosis.write(d, self.run.path)
                fr = flight_recorder.dump_run(self.run.path)
                text = (
                    f"{diagnosis.render(d)}\n  Flight Recorder dumps: {fr} "
                    f"(python -m torch.distributed.flight_recorder.fr_trace {fr} -p {flight_recorder.PREFIX})"
                )
            except OSError as err:  # a full disk: the diagnosis still reaches the user, unsaved
                why = err.strerror or str(err)
                path = f"(not saved: {why})"
                text = f"{diagnosis.render(d)}\n  (the report and Flight Recorder dumps could not be saved: {why})"
            self.emit(s.HangReport(comm=finding.comm, seq=finding.seq, text=text, path=path))
            missing = ", ".join(map(str, finding.missing))
            what = (f"world formation (init_process_group) of {finding.comm}" if finding.kind is s.HangKind.WORLD
                    else f"collective #{finding.seq} ({finding.op.name}) of {label}")
            summary = summary or f"hang in {what}: missing ranks {{{missing}}}; report: {path}"

    def _failure_summary(self, index: int, code: int) -> str:
        """Who failed first (``procs[index]``) and how, then which ranks raised (and where their logs are)."""
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        launched = self.procs[index]
        node, pid = launched.node, launched.proc.pid
        # with direct launch the node process is the rank itself; with --nproc-per-node mirage knows its rank
        who = next((f"rank {r}" for r, p in self.state.rank_pids.items() if p == pid), f"node {node}")
        if launched.rank is not None:
            who = f"rank {launched.rank}"
        if who.startswith("node") and is_torchrun_agent(["", *self.topology.command]):
            who = f"node {node} (torchrun's agent)"
        raised: dict[int, str] = {}
        for name in sorted(os.listdir(self.run.ranks)):
            if name.endswith(".stderr"):
                with open(os.path.join(self.run.ranks, name), "rb") as f:
                    if b"Traceback (most recent call last)" in f.read():
                        rank = int(name.split("-")[1].split(".")[0])
                        raised[rank] = f"rank {rank} raised (log: {self.run.rank_log(rank)})"
        first_gone = ""
        # a rank that vanished without a traceback (killed, aborted) is the likelier cause
        gone = self.state.gone  # in the order the daemon noticed them
        if gone and not who.startswith("rank") and gone[0] not in raised:
            r = gone[0]
            first_gone = f"; rank {r} was the first rank to go (log: {self.run.rank_log(r)})"
        log = self.run.node_log(node) if launched.rank is None else self.run.rank_log(launched.rank)
        where = "; ".join(raised.values()) or f"log: {log}"
        return f"{who} {how}{first_gone}; {where}"

    def _note_exit(self, index: int) -> bool:
        """Note that ``procs[index]`` ended, the first time it is seen; True if this was it.

        A node process's end is emitted as ``process_exited`` at once. Rank processes
        (``--nproc-per-node``) end their node when the last of them ends: one
        ``process_exited`` per node, as a node process's, with the code of the first
        of its ranks that failed (and that rank's pid), else 0.
        """
        if index in self._exited:
            return False
        self._exited.append(index)
        launched = self.procs[index]
        if launched.rank is None:
            self.emit(s.ProcessExited(node=launched.node, pid=launched.proc.pid, returncode=launched.proc.returncode))
            return True
        mates = [i for i, p in enumerate(self.procs) if p.node == launched.node]
        if all(i in self._exited for i in mates):
            ended = [self.procs[i].proc for i in self._exited if i in mates]  # in the order they ended
            first = next((p for p in ended if p.returncode != 0), ended[-1])
            self.emit(s.ProcessExited(node=launched.node, pid=first.pid, returncode=first.returncode))
        return True

    def _terminate_nodes(self) -> None:
        self._tearing_down = True
        for proc in (launched.proc for launched in self.procs):
            # the group too when its leader is gone: a dead torchrun agent leaves workers
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + TERM_GRACE_S
        for proc in (launched.proc for launched in self.procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for i in range(len(self.procs)):
            self._note_exit(i)

    def _sweep(self) -> None:
        """Kill anything still carrying this session's id (escaped process groups)."""
        me = os.getpid()
        for p in psutil.process_iter(["pid"]):
            if p.pid == me:
                continue
            try:
                if p.environ().get("MIRAGE_SESSION") == self.run.session:
                    p.kill()
            except (psutil.Error, OSError):
                continue
        for path in session_segments(self.run.session):
            try:
                os.unlink(path)
            except OSError:
                pass

    def stop(self) -> None:
        """Tear down: nodes, then the daemon, then stragglers; flush the journal."""
        self._terminate_nodes()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self._sweep()
        self._stop.set()
        for t in self._threads:
            if t.name != "dispatch":
                self._join(t)  # a flood of output still in the rank files takes a while to record

    def _join(self, t: threading.Thread) -> None:
        """Join ``t`` while events keep being recorded; give up after ``DRAIN_STALL_S`` without progress."""
        last, since = -1, time.monotonic()
        while t.is_alive():
            t.join(0.2)
            if self._written != last:
                last, since = self._written, time.monotonic()
            elif time.monotonic() - since > DRAIN_STALL_S:
                return

    def _offer(self, item: tuple[s.Event, bytes | None] | None) -> bool:
        """Queue ``item`` while the dispatcher makes progress; False if it stalled (a display that stopped reading)."""
        last, since = -1, time.monotonic()
        while True:
            try:
                self._events.put(item, timeout=0.2)
                return True
            except queue.Full:
                if self._written != last:
                    last, since = self._written, time.monotonic()
                elif time.monotonic() - since > DRAIN_STALL_S:
                    return False

    def close(self, outcome: Outcome | None) -> None:
        """Record the end and close the journal (after :meth:`stop`)."""
        ended = outcome is None or self._offer((s.SessionEnded(returncode=outcome.returncode, summary=outcome.summary),
                                                None))
        queued = ended and self._offer(None)
        for t in self._threads:
            if t.name == "dispatch":
                if queued:
                    self._join(t)
                if t.is_alive():
                    print(f"mirage: the event journal stalled; {self.run.events} may be incomplete", file=sys.stderr)
        try:
            self._journal.close()
        except OSError as err:
            self._write_failed(self.run.events, err)
        report.write(self.state, self.topology, outcome, self.run)
        self.trace = kineto_trace.merge_traces(self.run.path)  # the ranks' traces/rank-R.json, if any
        for path, f in self._log_files.items():
            try:
                f.close()  # type: ignore[attr-defined]
            except OSError as err:  # a full disk: already the run's outcome, or too late to change it
                self._write_failed(path, err)
        self._ctx.destroy(linger=0)
        try:
            os.unlink(self.run.token_file)  # the token is useless once the daemon is gone
        except OSError:
            pass
        for node in range(self.topology.num_nodes):  # they hold the token too
            try:
                os.unlink(sessions.node_env_path(self.run.path, node))
            except OSError:
                pass
        sessions.unregister(self.run.session)

