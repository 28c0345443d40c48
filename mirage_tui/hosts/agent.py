"""One host's agent in a multi-host run (``mirage run --launcher slurm``).

The head's session starts one agent per host with ``srun``. An agent connects
to the session (CURVE over TCP: :mod:`mirage_tui.hosts.protocol`), says which
host it is, and then does on its host what the session does on its own: starts
the emulated nodes' programs the session sends it (:class:`~mirage_tui.hosts.protocol.Launch`),
reads their output (rank files in a local run directory, node pipes) and sends
it on, reports each process's end, sends the ranks' clocked traces at the end, watches the host's rank processes for the
daemon (which cannot see them), and dumps their stacks when a hang is reported.
It stops everything it started, and every process that inherited its host tag,
when the session says :class:`~mirage_tui.hosts.protocol.Done`, when it is signalled (``scancel``,
Ctrl-C through ``srun``), or when the session has been silent for
``SILENCE_S`` (its host died, or the network between them).

The local run directory (``$TMPDIR/mirage-<uid>/agent-<session>-<host>``, 0700)
stays after the run: the rank files as the ranks wrote them, beside the copy of
every line in the head's run directory.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time

import zmq

from mirage_tui.hosts import netif
from mirage_tui.hosts import protocol as ap
from mirage_tui.hosts.daemon_proc import DaemonSettings, DaemonStartError, StartedDaemon, start_daemon
from mirage_tui.hosts.processes import StartError, free_port, kill_carrying, signal_group, spawn, stop_child, terminate
from mirage_tui.output import RankTail, pump_pipe
from mirage_tui.reports import diagnosis
from wire import kineto_trace
from wire import schema as s
from wire.endpoints import endpoints
from wire.procfs import ended

#: Every process the agent starts carries it: its sweep at the end finds them by it.
HOST_TAG = ap.HOST_TAG
#: A trace travels in parts of this many characters (the head takes messages up to 64 MiB).
TRACE_PART_CHARS = 4 << 20
#: At the end, the host daemon's events are forwarded until it has been quiet this long.
EVENTS_DRAIN_S = 0.1
#: How long this host's daemon has to take the other hosts' peer endpoints.
LINK_TIMEOUT_S = 5.0


class Agent:
    """The agent of one host; :meth:`serve` runs it until the run ends."""

    def __init__(self, bus: str, server_key: str, token: str, session: str, slurm_node: int,
                 settings: DaemonSettings):
        self.host = socket.gethostname()
        self.session = session
        self.token = token
        self.interface, self.address = netif.choose()
        base = os.path.join(tempfile.gettempdir(), f"mirage-{os.getuid()}")
        os.makedirs(base, mode=0o700, exist_ok=True)
        self.run_dir = os.path.join(base, f"agent-{session}-{self.host}")
        self.ranks_dir = os.path.join(self.run_dir, "ranks")
        for folder in (self.run_dir, self.ranks_dir):  # 0700 both: the host daemon's sockets are in the first
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)  # the last output and Finished still go out
        self.sock.curve_serverkey = server_key.encode()
        self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(bus)
        self.slurm_node = slurm_node
        self.procs: list[subprocess.Popen | None] = []  # in Launch order; None: it could not start
        self.reported: set[int] = set()  # indexes of procs whose end was sent
        self.watched: dict[int, int] = {}  # rank -> pid
        self.lines: queue.Queue[s.OutputLine] = queue.Queue()
        self.tail = RankTail(self.ranks_dir)
        self.pumps = []
        self.heard = time.monotonic()
        self.stopping = False
        self.finished = False
        self.settings = settings
        self.daemon: StartedDaemon | None = None  # the host's own, once started (serve)
        self.token_file = os.path.join(self.run_dir, "token")
        self.daemon_reported = False  # whether its death was told
        self.launched: list[ap.Process] = []  # every process the session had this host start

    def send(self, msg: ap.AgentMessage) -> None:
        self.sock.send(ap.encode(msg))

    def start_daemon(self) -> None:
        """Start this host's daemon: it serves the communicators whose members all run here, over shared memory
        as on one machine (its sockets in the 0700 run directory, ipc:// only)."""
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        env = dict(os.environ, MIRAGE_SESSION=self.session, **{HOST_TAG: self.host})
        # --peer-listen: it links to the other hosts' daemons on this host's interface, for communicators across hosts
        self.daemon = start_daemon(self.ctx, self.run_dir, self.session, self.token, self.token_file, self.settings,
                                   env, os.path.join(self.run_dir, "daemon.log"), ["--peer-listen", self.address])

    def serve(self) -> int:
        """Run until Done (0), until the session goes silent (1), or until signalled (143)."""
        try:
            self.start_daemon()
        except (DaemonStartError, OSError) as e:
            print(f"mirage node {self.host}: could not start this host's daemon: {e}", file=sys.stderr, flush=True)
            self.stop()
            return 1
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.daemon.events, zmq.POLLIN)
        ready = self.daemon.ready
        self.send(ap.AgentHello(token=self.token, host=self.host, address=self.address, slurm_node=self.slurm_node,
                                pid=os.getpid(), master_port=free_port(self.address),
                                peer_endpoint=ready.peer_endpoint, peer_cipher=ready.peer_cipher))
        beat = 0.0
        code = 0
        try:
            while True:
                if self.stopping:
                    code = 143
                    break
                ready = dict(poller.poll(50))
                if self.daemon.events in ready:
                    self.forward_events()
                if self.sock in ready and self.handle_all():
                    break
                now = time.monotonic()
                if now - self.heard > ap.SILENCE_S:
                    print(f"mirage node {self.host}: the session has been silent for {ap.SILENCE_S:.0f} s; "
                          f"stopping this host's processes", file=sys.stderr, flush=True)
                    code = 1
                    break
                if now - beat >= ap.HEARTBEAT_S:
                    self.send(ap.Heartbeat())
                    beat = now
                self.check_daemon()
                self.check_processes()
                self.send_output()
        finally:
            self.stop()
        return code

    def handle_all(self) -> bool:
        """Handle every message waiting; True once the session said Done."""
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self.heard = time.monotonic()
            try:
                msg = ap.decode(data)
            except s.SchemaError as e:
                print(f"mirage node {self.host}: ignored a malformed message: {e}", file=sys.stderr, flush=True)
                continue
            if isinstance(msg, ap.Done):
                return True
            self.handle(msg)

    def handle(self, msg: ap.AgentMessage) -> None:
        if isinstance(msg, ap.Launch):
            self.launch(msg)
        elif isinstance(msg, ap.Peers):
            self.link_daemon(msg.hosts, msg.key)
        elif isinstance(msg, ap.Watch):
            self.watched[msg.rank] = msg.pid
        elif isinstance(msg, ap.Kill):
            targets = self.procs if msg.index < 0 else self.procs[msg.index:msg.index + 1]
            for proc in targets:
                if proc is not None:
                    signal_group(proc.pid, msg.signal)
        elif isinstance(msg, ap.DumpStacks):
            pids = {int(r): pid for r, pid in msg.ranks.items()}
            stacks = diagnosis.dump_stacks(pids, self.ranks_dir, self.session)
            self.send(ap.Stacks(req=msg.req, ranks={
                str(r): [diagnosis.process_status(pid), stacks.get(r, "")] for r, pid in pids.items()}))

    def link_daemon(self, hosts: dict[str, list[str]], key: str) -> None:
        """Hand this host's daemon the other hosts' daemons' peer endpoints and the run key that seals their links
        (they came over the CURVE bus from the head, so a daemon links only to the run's own). Done before any
        rank starts: Peers precedes Launch. A daemon that cannot link says so in the first node's log; its ranks' groups across hosts then
        fail when made, naming the hosts."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints(self.run_dir)[0])
        try:
            dealer.send(s.encode(s.PeerDirectory(peers=hosts, key=key), token=self.token))
            reply = s.decode(dealer.recv()) if dealer.poll(LINK_TIMEOUT_S * 1000) else None
        finally:
            dealer.close(0)
        if not isinstance(reply, s.Ok):
            why = reply.message if isinstance(reply, s.Error) else f"no answer within {LINK_TIMEOUT_S:.0f} s"
            node = min((p.node for p in self.launched), default=0)
            self.lines.put(s.OutputLine(node=node, stream=s.Stream.STDERR, text=(
                f"mirage node {self.host}: this host's daemon could not link to the other hosts' daemons: {why}")))

    def forward_events(self) -> None:
        """Send the session what this host's daemon published (the head records them as its own daemon's)."""
        while True:
            try:
                frame = self.daemon.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.send(ap.DaemonEvents(lines=frame.decode().split("\n")))

    def check_daemon(self) -> None:
        """Say so once if this host's daemon died: the ranks here fail on their own (their daemon is gone)."""
        proc = self.daemon.proc
        if proc.poll() is not None and not self.daemon_reported:
            self.daemon_reported = True
            node = min((p.node for p in self.launched), default=0)  # the line goes to the host's first node's log
            self.lines.put(s.OutputLine(node=node, stream=s.Stream.STDERR, text=(
                f"mirage node {self.host}: this host's daemon (pid {proc.pid}) exited with code {proc.returncode}; "
                f"see {self.run_dir}/daemon.log")))

    def launch(self, msg: ap.Launch) -> None:
        self.launched += msg.processes
        for p in msg.processes:
            # the head's daemon (MIRAGE_ENDPOINT) serves communicators across hosts; this host's, the rest
            env = dict(p.env, MIRAGE_RUN_DIR=self.run_dir, MIRAGE_SOCKET_IF=f"{self.interface}:{self.address}",
                       MIRAGE_HOST_ENDPOINT=endpoints(self.run_dir)[0], MIRAGE_HOST_DAEMON_PID=str(self.daemon.proc.pid),
                       **{HOST_TAG: self.host})
            try:
                proc = spawn(msg.command, env, msg.workdir or None, self.ranks_dir, p.rank)
            except StartError as e:  # its end is the failure the session reports
                self.lines.put(s.OutputLine(node=p.node, stream=s.Stream.STDERR, text=f"mirage node {self.host}: {e}"))
                self.send_output()
                self.reported.add(len(self.procs))
                self.send(ap.Exited(index=len(self.procs), pid=0, returncode=e.returncode))
                self.procs.append(None)
                continue
            self.procs.append(proc)
            if p.rank is None:
                self.pumps.append(pump_pipe(proc.stdout, p.node, s.Stream.STDOUT, self.lines.put))
                self.pumps.append(pump_pipe(proc.stderr, p.node, s.Stream.STDERR, self.lines.put))

    def check_processes(self) -> None:
        for i, proc in enumerate(self.procs):
            if i not in self.reported and proc is not None and proc.poll() is not None:
                self.reported.add(i)
                self.send_output(final=False)  # its last lines before its end
                self.send(ap.Exited(index=i, pid=proc.pid, returncode=proc.returncode))
        for rank, pid in ended(list(self.watched.items())):
            del self.watched[rank]
            self.send(ap.RankGone(rank=rank, pid=pid))
        if self.procs and not self.finished and len(self.reported) == len(self.procs):
            for t in self.pumps:
                t.join(1.0)
            self.send_output(final=True)
            self.drain_events()
            self.send_traces()
            self.send(ap.Finished())
            self.finished = True

    def send_traces(self) -> None:
        """Send the clocked traces this host's ranks wrote, so that the head's run directory has every rank's."""
        folder = os.path.join(self.run_dir, kineto_trace.TRACES_DIR)
        for _, name in kineto_trace.rank_traces(folder):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    data = f.read()
            except (OSError, ValueError) as e:  # the head's merge names a rank it lacks
                print(f"mirage node {self.host}: could not read the trace {name}: {e}", file=sys.stderr, flush=True)
                continue
            parts = range(0, len(data), TRACE_PART_CHARS)
            for i, at in enumerate(parts):
                self.send(ap.TraceFile(name=name, part=i, data=data[at:at + TRACE_PART_CHARS],
                                       last=i == len(parts) - 1))

    def drain_events(self) -> None:
        """Forward the daemon's last events: it sends them in batches, a few milliseconds apart."""
        while self.daemon.events.poll(EVENTS_DRAIN_S * 1000):
            self.forward_events()

    def send_output(self, final: bool = False) -> None:
        lines = self.tail.poll(final=final)
        while True:
            try:
                lines.append(self.lines.get_nowait())
            except queue.Empty:
                break
        for i in range(0, len(lines), 500):
            self.send(ap.Output(lines=[s.encode(line).decode() for line in lines[i:i + 500]]))

    def stop(self) -> None:
        """Stop every process started here (and any that kept the host tag), send the last output, close."""
        terminate([p for p in self.procs if p is not None])
        if self.daemon is not None:
            stop_child(self.daemon.proc)
        kill_carrying(MIRAGE_SESSION=self.session, **{HOST_TAG: self.host})
        try:
            os.unlink(self.token_file)
        except FileNotFoundError:
            pass
        try:
            self.check_processes()
            self.send_output(final=True)
        except zmq.ZMQError:
            pass
        self.ctx.destroy(linger=1000)


def main(argv: list[str] | None = None) -> int:
    """``python -m mirage_tui.hosts.agent [daemon flags]``, started by the session through ``srun`` with its daemon's
    settings (:meth:`DaemonSettings.args`); its environment says the rest."""
    settings = DaemonSettings.parse(argv, "python -m mirage_tui.hosts.agent")
    env = os.environ
    missing = [k for k in ("MIRAGE_AGENT_BUS", "MIRAGE_SERVER_KEY", "MIRAGE_TOKEN", "MIRAGE_SESSION") if not env.get(k)]
    if missing:
        print(f"mirage_tui.hosts.agent: {', '.join(missing)} not set; the agent is started by "
              f"'mirage run --launcher slurm', not by hand", file=sys.stderr)
        return 2
    agent = Agent(env["MIRAGE_AGENT_BUS"], env["MIRAGE_SERVER_KEY"], env["MIRAGE_TOKEN"], env["MIRAGE_SESSION"],
                  int(env.get("SLURM_NODEID", "0") or 0), settings)

    def stop(signum, frame):
        agent.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return agent.serve()


if __name__ == "__main__":
    sys.exit(main())
