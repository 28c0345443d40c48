"""The head's side of a multi-host run (``--launcher slurm``): one agent per host, started with ``srun``.

:class:`Hosts` binds the session's agent bus (ZeroMQ ROUTER, TCP on the chosen
interface only, CURVE), starts ``srun ... python -m mirage_tui.hosts.agent``
inside the Slurm allocation, waits until every host's agent has said hello
with the session token, and then carries the session's orders to the hosts
(launch, kill, watch, dump stacks) and their news back: output lines, process
ends, rank processes gone, clocked traces, and a host that stopped answering. One thread owns
the socket; other threads queue what they send.

Each launched process on another host is a :class:`RemoteProcess`, which the
session polls, waits for and signals as it does a local ``Popen``.
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from mirage_tui.hosts import protocol as ap
from mirage_tui.hosts.processes import signal_group
from wire import kineto_trace
from wire import schema as s

#: How long every host's agent has to start and say hello (srun, Python, the imports).
HELLO_TIMEOUT_S = 60.0
#: How long a host has to answer a stack dump.
STACKS_TIMEOUT_S = 4.0
#: What a host's daemon speaks for: its communicators (all inside the host) and what it found in them. The
#: ranks themselves (registered, gone), their memory and steps are the head's daemon's to report, once.
HOST_DAEMON_EVENTS = (s.CommJoined, s.CollectiveEnqueued, s.CollectiveStarted, s.CollectiveProgress,
                      s.CollectiveCompleted, s.CommFailed, s.HangDetected, s.StragglerWarning, s.ProtocolError)


class HostsError(Exception):
    """The hosts' agents could not all be started (srun failed, or a host never answered)."""


@dataclass
class Agent:
    """One host's agent, as the session knows it."""

    identity: bytes
    hello: ap.AgentHello
    heard: float = field(default_factory=time.monotonic)
    finished: bool = False
    lost: str = ""  # why the host is taken for gone ("" while it answers)
    procs: list[RemoteProcess] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)  # the emulated nodes it runs
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> pid of its registered ranks
    trace_parts: dict[str, int] = field(default_factory=dict)  # trace file -> the next part expected

    @property
    def host(self) -> str:
        return self.hello.host


class RemoteProcess:
    """A process an agent started, with the part of ``subprocess.Popen`` the session uses."""

    def __init__(self, hosts: Hosts, agent: Agent, index: int):
        self._hosts = hosts
        self.agent = agent
        self.index = index
        self.pid = 0  # known once it ended (the agent reports pids with ends)
        self.returncode: int | None = None
        self._ended = threading.Event()

    def ended(self, pid: int, returncode: int) -> None:
        if self.returncode is None:
            self.pid, self.returncode = pid, returncode
            self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"{self.agent.host}#{self.index}", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Signal the process group on its host."""
        self._hosts.send(self.agent, ap.Kill(index=self.index, signal=sig))


class Hosts:
    """The session's agents: start them, wait for them, talk to them (see the module docstring)."""

    def __init__(self, address: str, secret_key: bytes, token: str, session: str, run_dir: str,
                 emit: Callable[[s.Event, bytes | None], None], on_rank_gone: Callable[[str, int, int], None]):
        self.token = token
        self.traces_dir = os.path.join(run_dir, kineto_trace.TRACES_DIR)
        self.session = session
        self.emit = emit
        self.on_rank_gone = on_rank_gone  # (host, rank, pid): the daemon must hear of it
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ap.MAX_AGENT_MESSAGE_BYTES)
        self.public_key = zmq.curve_public(secret_key)  # the agents' MIRAGE_SERVER_KEY
        self.sock.curve_secretkey = secret_key
        self.sock.curve_publickey = self.public_key
        self.sock.curve_server = True
        self.sock.bind(f"tcp://{address}:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.agents: dict[bytes, Agent] = {}
        self.srun: subprocess.Popen | None = None
        self._outbox: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._stacks: dict[int, tuple[threading.Event, dict[int, tuple[str, str]]]] = {}
        self._reqs = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hosts", daemon=True)
        self._trace_heard = 0.0  # when the last part of a trace arrived
        self.ignored = 0  # messages from connections that never presented the token, or malformed
        self._lock = threading.Lock()  # guards each Agent.ranks (the dispatcher adds, this thread reads)

    # ------------------------------------------------------------ start

    def start(self, hosts: int, env: dict[str, str], log_path: str, daemon_args: list[str]) -> list[Agent]:
        """Start one agent per host with srun (each starts its host's daemon with ``daemon_args``); return them
        in Slurm's node order once each said hello."""
        env = dict(env, MIRAGE_AGENT_BUS=self.endpoint, MIRAGE_SERVER_KEY=self.public_key.decode(),
                   MIRAGE_TOKEN=self.token, MIRAGE_SESSION=self.session)
        log = open(log_path, "ab")
        try:
            self.srun = subprocess.Popen(
                ["srun", f"--nodes={hosts}", f"--ntasks={hosts}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                 f"--job-name=mirage-{self.session}", sys.executable, "-m", "mirage_tui.hosts.agent", *daemon_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True,
            )
        except FileNotFoundError:
            raise HostsError("--launcher slurm needs srun on PATH") from None
        finally:
            log.close()
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while len(self.agents) < hosts:
            if self.srun.poll() is not None:
                raise HostsError(f"srun exited with code {self.srun.returncode} before every host's agent "
                                 f"started ({len(self.agents)} of {hosts}); see {log_path}")
            if time.monotonic() > deadline:
                raise HostsError(f"only {len(self.agents)} of {hosts} hosts' agents said hello within "
                                 f"{HELLO_TIMEOUT_S:.0f} s; see {log_path}")
            if self.sock.poll(100):
                self._receive()
        # every host's daemon learns where the others take peer links (before any Launch: same pipe, in order)
        peers = ap.Peers(hosts={a.host: [a.hello.peer_endpoint, a.hello.peer_cipher] for a in self.agents.values()
                                if a.hello.peer_endpoint}, key=secrets.token_hex(32))
        for agent in self.agents.values():
            self.sock.send_multipart([agent.identity, ap.encode(peers)])
        self._thread.start()
        return sorted(self.agents.values(), key=lambda a: a.hello.slurm_node)

    # ------------------------------------------------------------ to the agents (any thread)

    def send(self, agent: Agent, msg: ap.AgentMessage) -> None:
        self._outbox.put((agent.identity, ap.encode(msg)))

    def launch(self, agent: Agent, command: list[str], workdir: str | None,
               processes: list[ap.Process]) -> list[RemoteProcess]:
        """Have ``agent`` start ``processes``; their handles, in order."""
        procs = [RemoteProcess(self, agent, len(agent.procs) + i) for i in range(len(processes))]
        agent.procs.extend(procs)
        agent.nodes = sorted(set(agent.nodes) | {p.node for p in processes})
        self.send(agent, ap.Launch(command=list(command), workdir=workdir or "", processes=processes))
        return procs

    def watch(self, host: str, rank: int, pid: int) -> bool:
        """Have ``host``'s agent watch rank ``rank`` (process ``pid``); False if no agent runs there."""
        for agent in self.agents.values():
            if agent.host == host:
                with self._lock:
                    agent.ranks[rank] = pid
                self.send(agent, ap.Watch(rank=rank, pid=pid))
                return True
        return False

    def remote_stacks(self, ranks: dict[int, int]) -> dict[int, tuple[str, str]]:
        """Each rank's (process status, stacks), from the agent of the host it runs on (``diagnosis.Remote``)."""
        out: dict[int, tuple[str, str]] = {}
        waits = []
        for agent in self.agents.values():
            with self._lock:
                mine = {str(r): p for r, p in ranks.items() if agent.ranks.get(r) == p}
            if not mine:
                continue
            if agent.lost:
                out.update({int(r): (f"unknown (host {agent.host} lost)", "") for r in mine})
                continue
            req = next(self._reqs)
            done = threading.Event()
            self._stacks[req] = (done, out)
            self.send(agent, ap.DumpStacks(req=req, ranks=mine))
            waits.append(done)
        deadline = time.monotonic() + STACKS_TIMEOUT_S
        for done in waits:
            done.wait(max(0.0, deadline - time.monotonic()))
        return out

    # ------------------------------------------------------------ the socket's thread

    def _serve(self) -> None:
        beat = 0.0
        while not self._stop.is_set():
            while True:
                try:
                    identity, data = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self.sock.send_multipart([identity, data])
            now = time.monotonic()
            if now - beat >= ap.HEARTBEAT_S:
                for agent in self.agents.values():
                    if not agent.lost:
                        self.sock.send_multipart([agent.identity, ap.encode(ap.Heartbeat())])
                beat = now
            if self.sock.poll(20):
                self._receive()
            self._check_silence()

    def _receive(self) -> None:
        while True:
            try:
                identity, data = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not [identity, frame]
                self.ignored += 1
                continue
            try:
                msg = ap.decode(data)
            except s.SchemaError:
                self.ignored += 1
                continue
            agent = self.agents.get(identity)
            if agent is None:
                if isinstance(msg, ap.AgentHello) and msg.token == self.token:
                    self.agents[identity] = Agent(identity, msg)
                else:
                    self.ignored += 1
                continue
            if agent.lost:
                continue  # a host taken for gone stays gone: its processes were reported ended
            agent.heard = time.monotonic()
            self._handle(agent, msg)

    def _handle(self, agent: Agent, msg: ap.AgentMessage) -> None:
        if isinstance(msg, ap.Output):
            for event, line in s.iter_events([x.encode() for x in msg.lines]):
                if isinstance(event, s.OutputLine):  # an agent speaks only for its programs' output
                    self.emit(event, line)
        elif isinstance(msg, ap.DaemonEvents):
            for event, line in s.iter_events([x.encode() for x in msg.lines]):
                if isinstance(event, HOST_DAEMON_EVENTS):
                    self.emit(event, line)
                else:
                    self.ignored += 1
        elif isinstance(msg, ap.Exited):
            if 0 <= msg.index < len(agent.procs):
                agent.procs[msg.index].ended(msg.pid, msg.returncode)
        elif isinstance(msg, ap.RankGone):
            with self._lock:
                known = agent.ranks.get(msg.rank) == msg.pid
                if known:
                    del agent.ranks[msg.rank]
            if known:
                self.on_rank_gone(agent.host, msg.rank, msg.pid)
        elif isinstance(msg, ap.Stacks):
            done, out = self._stacks.pop(msg.req, (None, None))
            if done is not None:
                out.update({int(r): (v[0], v[1]) if len(v) == 2 else ("unknown", "") for r, v in msg.ranks.items()})
                done.set()
        elif isinstance(msg, ap.TraceFile):
            self._trace_part(agent, msg)
        elif isinstance(msg, ap.Finished):
            agent.finished = True

    def _trace_part(self, agent: Agent, msg: ap.TraceFile) -> None:
        """Add a part of a rank's trace to the run directory's ``traces/``; the file appears when complete."""
        if not kineto_trace.RANK_TRACE.fullmatch(msg.name) or msg.part != agent.trace_parts.get(msg.name, 0):
            self.ignored += 1  # not a trace's name (a path, say), or a part out of order
            return
        path = os.path.join(self.traces_dir, msg.name)
        try:
            os.makedirs(self.traces_dir, exist_ok=True)
            with open(path + ".part", "w" if msg.part == 0 else "a", encoding="utf-8") as f:
                f.write(msg.data)
            if msg.last:
                os.replace(path + ".part", path)
        except OSError as e:  # the merge will name the rank it lacks
            print(f"mirage: could not write {msg.name} from {agent.host}: {e}", file=sys.stderr)
        agent.trace_parts[msg.name] = msg.part + 1
        self._trace_heard = time.monotonic()

    def _check_silence(self) -> None:
        now = time.monotonic()
        for agent in self.agents.values():
            if agent.lost or agent.finished and all(p.returncode is not None for p in agent.procs):
                continue
            if now - agent.heard > ap.SILENCE_S:
                self.lose(agent, f"its agent has not answered for {now - agent.heard:.1f} s")

    def lose(self, agent: Agent, why: str) -> None:
        """Take ``agent``'s host for gone: its processes end as killed, its ranks are gone for the daemon."""
        agent.lost = why
        with self._lock:
            ranks = sorted(agent.ranks.items())
        self.emit(s.HostLost(host=agent.host, nodes=list(agent.nodes), ranks=[r for r, _ in ranks], why=why), None)
        for rank, pid in ranks:
            self.on_rank_gone(agent.host, rank, pid)
        for proc in agent.procs:
            proc.ended(proc.pid, -signal.SIGKILL)

    # ------------------------------------------------------------ end

    def finish(self, grace_s: float = 5.0) -> None:
        """Tell every agent the run is over, wait for srun to end (then stop it), close the bus."""
        # each host's last output lines and traces come before its Finished: wait 2 s, and while traces arrive
        start = time.monotonic()
        while self._thread.is_alive() and time.monotonic() < max(start, self._trace_heard) + 2.0 and not all(
                a.finished or a.lost for a in self.agents.values()):
            time.sleep(0.02)
        for agent in self.agents.values():
            if not agent.lost:
                self.send(agent, ap.Done())
        if self._thread.is_alive():
            while not self._outbox.empty() and self._thread.is_alive():
                time.sleep(0.02)  # the socket's thread sends them
            self._stop.set()
            self._thread.join(2.0)
        else:  # it never started (a host missing at start): this thread owns the socket
            while not self._outbox.empty():
                self.sock.send_multipart(list(self._outbox.get_nowait()))
        if self.srun is not None:
            # with a host lost, srun waits for its slurmd until Slurm's own timeout: cancel the step at once
            lost = any(a.lost for a in self.agents.values())
            try:
                self.srun.wait(0.5 if lost else grace_s)
            except subprocess.TimeoutExpired:
                for _ in range(2):  # srun: two SIGINTs within a second cancel the step
                    signal_group(self.srun.pid, signal.SIGINT)
                    time.sleep(0.2)
                try:
                    self.srun.wait(2.0)
                except subprocess.TimeoutExpired:
                    signal_group(self.srun.pid, signal.SIGKILL)
                    self.srun.wait()
        self.ctx.destroy(linger=500)
