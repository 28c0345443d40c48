"""One host's agent in a multi-host run (``mirage run --launcher slurm``).

The head's session starts one agent per host with ``srun``. An agent connects
to the session (CURVE over TCP: :mod:`mirage_tui.agent_protocol`), says which
host it is, and then does on its host what the session does on its own: starts
the emulated nodes' programs the session sends it (:class:`~agent_protocol.Launch`),
reads their output (rank files in a local run directory, node pipes) and sends
it on, reports each process's end, sends the ranks' clocked traces at the end, watches the host's rank processes for the
daemon (which cannot see them), and dumps their stacks when a hang is reported.
It stops everything it started, and every process that inherited its host tag,
when the session says :class:`~agent_protocol.Done`, when it is signalled (``scancel``,
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

from emulator import kineto_trace
from emulator import schema as s
from emulator.lifetime import alive
from mirage_tui import agent_protocol as ap
from mirage_tui import diagnosis, netif
from mirage_tui.output import RankTail, pump_pipe
from mirage_tui.processes import StartError, free_port, kill_carrying, signal_group, spawn, terminate

#: Every process the agent starts carries it: its sweep at the end finds them by it.
HOST_TAG = ap.HOST_TAG
#: A trace travels in parts of this many characters (the head takes messages up to 64 MiB).
TRACE_PART_CHARS = 4 << 20


class Agent:
    """The agent of one host; :meth:`serve` runs it until the run ends."""

    def __init__(self, bus: str, server_key: str, token: str, session: str, slurm_node: int):
        self.host = socket.gethostname()
        self.session = session
        self.token = token
        self.interface, self.address = netif.choose()
        base = os.path.join(tempfile.gettempdir(), f"mirage-{os.getuid()}")
        os.makedirs(base, mode=0o700, exist_ok=True)
        self.run_dir = os.path.join(base, f"agent-{session}-{self.host}")
        self.ranks_dir = os.path.join(self.run_dir, "ranks")
        os.makedirs(self.ranks_dir, mode=0o700, exist_ok=True)
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

    def send(self, msg: ap.AgentMessage) -> None:
        self.sock.send(ap.encode(msg))

    def serve(self) -> int:
        """Run until Done (0), until the session goes silent (1), or until signalled (143)."""
        self.send(ap.AgentHello(token=self.token, host=self.host, address=self.address, slurm_node=self.slurm_node,
                                pid=os.getpid(), master_port=free_port(self.address)))
        beat = 0.0
        code = 0
        try:
            while True:
                if self.stopping:
                    code = 143
                    break
                if self.sock.poll(50):
                    if self.handle_all():
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
            except ap.ProtocolError as e:
                print(f"mirage node {self.host}: ignored a malformed message: {e}", file=sys.stderr, flush=True)
                continue
            if isinstance(msg, ap.Done):
                return True
            self.handle(msg)

    def handle(self, msg: ap.AgentMessage) -> None:
        if isinstance(msg, ap.Launch):
            self.launch(msg)
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

    def launch(self, msg: ap.Launch) -> None:
        for p in msg.processes:
            env = dict(p.env, MIRAGE_RUN_DIR=self.run_dir, MIRAGE_SOCKET_IF=f"{self.interface}:{self.address}",
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
        for rank, pid in list(self.watched.items()):
            if not alive(pid):
                del self.watched[rank]
                self.send(ap.RankGone(rank=rank, pid=pid))
        if self.procs and not self.finished and len(self.reported) == len(self.procs):
            for t in self.pumps:
                t.join(1.0)
            self.send_output(final=True)
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
        kill_carrying(MIRAGE_SESSION=self.session, **{HOST_TAG: self.host})
        try:
            self.check_processes()
            self.send_output(final=True)
        except zmq.ZMQError:
            pass
        self.ctx.destroy(linger=1000)


def main(argv: list[str] | None = None) -> int:
    """``python -m mirage_tui.node_agent``, started by the session through ``srun`` (its environment says the rest)."""
    env = os.environ
    missing = [k for k in ("MIRAGE_AGENT_BUS", "MIRAGE_SERVER_KEY", "MIRAGE_TOKEN", "MIRAGE_SESSION") if not env.get(k)]
    if missing:
        print(f"mirage_tui.node_agent: {', '.join(missing)} not set; the agent is started by "
              f"'mirage run --launcher slurm', not by hand", file=sys.stderr)
        return 2
    agent = Agent(env["MIRAGE_AGENT_BUS"], env["MIRAGE_SERVER_KEY"], env["MIRAGE_TOKEN"], env["MIRAGE_SESSION"],
                  int(env.get("SLURM_NODEID", "0") or 0))

    def stop(signum, frame):
        agent.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return agent.serve()


if __name__ == "__main__":
    sys.exit(main())
