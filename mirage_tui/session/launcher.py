"""The processes a session starts for the command: one per emulated node, or (``--nproc-per-node``) one per rank.

It gives each the environment that leads it to the session's daemon and rendezvous
(:mod:`~mirage_tui.config.launch_env`), starts it here (:func:`~mirage_tui.hosts.processes.spawn`) or, with
``--launcher slurm``, through the agent of a host of the allocation (:class:`~mirage_tui.hosts.head.Hosts`),
and keeps the list: which ended, in which order (a node's ``process_exited``), and stopping them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from mirage_tui.config.launch_env import RankEnvironment, node_env, rank_env
from mirage_tui.config.rundir import RunDir
from mirage_tui.config.topology import Launcher, Topology, slurm_hosts
from mirage_tui.hosts import protocol as ap
from mirage_tui.hosts.fork_server import ForkServer
from mirage_tui.hosts.head import Hosts, HostsError, RemoteProcess
from mirage_tui.hosts.processes import TERM_GRACE_S, StartError, free_port, signal_group, spawn
from mirage_tui.output import pump_pipe
from mirage_tui.session import registry as sessions
from mirage_tui.session.daemon import LaunchError, SessionDaemon
from mirage_tui.session.journal import Journal
from wire import schema as s
from wire.endpoints import endpoints


@dataclass(frozen=True)
class Launched:
    """One process the session started: a node's command, or (``--nproc-per-node``) one rank of a node."""

    proc: subprocess.Popen | RemoteProcess  # RemoteProcess: started by the agent of another host
    node: int
    rank: int | None = None  # the global rank mirage gave it; None for a node process

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group, on whichever host it runs."""
        if isinstance(self.proc, RemoteProcess):
            self.proc.send_signal(sig)
        else:
            signal_group(self.proc.pid, sig)


class NodeLauncher:
    """Start ``topology``'s command on its nodes, pointed at ``daemon``; output and ends go to ``journal``."""

    def __init__(self, topology: Topology, run: RunDir, daemon: SessionDaemon, journal: Journal):
        self.topology = topology
        self.run = run
        self.daemon = daemon
        self.journal = journal
        self.procs: list[Launched] = []  # every process started, in order: one per node, or one per rank
        self._exited: list[int] = []  # indexes into procs of the processes seen ended, in that order
        self.hosts: Hosts | None = None  # a multi-host run (--launcher slurm): the hosts' agents
        self._master_addr = "127.0.0.1"  # MASTER_ADDR: this machine, or the host of node 0
        self.fork_server: ForkServer | None = None  # this machine's, while it runs (--fork-server on)

    def where(self) -> RankEnvironment:
        """What every launched process is told about this session (:mod:`mirage_tui.config.launch_env`)."""
        daemon = self.daemon
        return RankEnvironment(
            topology=self.topology, session=self.run.session, run_dir=self.run.path, token=self.run.token,
            endpoint=daemon.tcp_endpoint or endpoints(self.run.path)[0], master_addr=self._master_addr,
            server_key=daemon.server_key if daemon.tcp_endpoint else "",
            daemon_pid=daemon.proc.pid if daemon.proc is not None and not daemon.tcp_endpoint else None,
            fork_server=self.fork_server.path if self.fork_server is not None else "",
        )

    def node_env(self, node: int, master_port: int) -> dict[str, str]:
        """The environment node process ``node`` starts with (:func:`mirage_tui.config.launch_env.node_env`)."""
        return node_env(self.where(), node, master_port)

    def rank_env(self, node: int, local_rank: int, master_port: int) -> dict[str, str]:
        """The environment of rank ``local_rank`` of node ``node`` (:func:`mirage_tui.config.launch_env.rank_env`)."""
        return rank_env(self.where(), node, local_rank, master_port)

    def start(self) -> None:
        """Start the command: a process per node, or per rank, here or on the hosts of a Slurm allocation."""
        if self.topology.launcher is Launcher.SLURM:
            return self._start_on_hosts()
        port = free_port()
        self._start_fork_server(port)
        for node in range(self.topology.num_nodes):  # for 'mirage exec SESSION --node N'
            sessions.write_node_env(self.run.path, node, self.node_env(node, port))
        nproc = self.topology.nproc_per_node
        for node in range(self.topology.num_nodes):
            if nproc is None:
                self._launch(node, None, self.node_env(node, port))
                continue
            for local in range(nproc):
                self._launch(node, node * nproc + local, self.rank_env(node, local, port))

    def _start_fork_server(self, port: int) -> None:
        """Start this machine's fork server, with the environment the nodes get (without it, ranks start as
        fresh interpreters, as with ``--fork-server off``)."""
        if not self.topology.fork_server or self.topology.in_process:
            return
        server = ForkServer(self.run.path)
        if server.start(self.node_env(0, port)):
            self.fork_server = server
        else:
            self.journal.emit(s.OutputLine(node=0, stream=s.Stream.STDERR, text=(
                f"mirage: the fork server did not start (see {server.log}); ranks start as new interpreters")))

    def _launch(self, node: int, rank: int | None, env: dict[str, str]) -> None:
        """Start the command as node ``node``'s process, or as its rank ``rank``; track it at once
        (:func:`mirage_tui.hosts.processes.spawn`: a rank's output goes to its rank files, a node's to pipes)."""
        topo = self.topology
        try:
            proc = spawn(topo.command, env, topo.workdir, self.run.ranks, rank)
        except StartError as e:
            raise LaunchError(str(e), e.returncode) from None
        self.procs.append(Launched(proc, node, rank))
        if rank is None:
            self.journal.fed_by(pump_pipe(proc.stdout, node, s.Stream.STDOUT, self.journal.emit))
            self.journal.fed_by(pump_pipe(proc.stderr, node, s.Stream.STDERR, self.journal.emit))

    def _start_on_hosts(self) -> None:
        """``--launcher slurm``: an agent per host of the allocation (srun), each host running its share of
        the nodes; node 0's host is the rendezvous (MASTER_ADDR), as the first host of a Slurm job is."""
        topo = self.topology
        with open(self.daemon.secret_file, "rb") as f:
            secret = f.read()
        self.hosts = Hosts(self.daemon.address, secret, self.run.token, self.run.session, self.run.path,
                           self.journal.emit, self.daemon.rank_exited)
        self.journal.on_registered = self._registered
        try:
            agents = self.hosts.start(slurm_hosts(), self.daemon.env(), os.path.join(self.run.path, "srun.log"),
                                      self.daemon.settings().args())
        except HostsError as e:
            raise LaunchError(str(e), 1) from None
        per_host = topo.num_nodes // len(agents)
        self._master_addr, port = agents[0].hello.address, agents[0].hello.master_port
        nproc = topo.nproc_per_node
        for h, agent in enumerate(agents):
            processes = []
            for node in range(h * per_host, (h + 1) * per_host):
                # for 'mirage exec SESSION --node N', which runs a probe on the node's host through srun
                sessions.write_node_env(self.run.path, node, {**self.node_env(node, port), ap.HOST_TAG: agent.host,
                                                              ap.SLURM_INDEX: str(agent.hello.slurm_node)})
                if nproc is None:
                    processes.append(ap.Process(node, None, self.node_env(node, port)))
                else:
                    processes += [ap.Process(node, node * nproc + local, self.rank_env(node, local, port))
                                  for local in range(nproc)]
            for proc, p in zip(self.hosts.launch(agent, list(topo.command), topo.workdir, processes), processes):
                self.procs.append(Launched(proc, p.node, p.rank))

    def _registered(self, e: s.RankRegistered) -> None:
        """A rank on another host: its agent watches the process for the daemon."""
        if self.hosts is not None and e.host and e.host != socket.gethostname():
            self.hosts.watch(e.host, e.rank, e.pid)

    def poll(self) -> tuple[int, list[tuple[int, int]]]:
        """How many processes still run, and those seen ended for the first time: (index into procs, exit code)."""
        running, ended = 0, []
        for i, launched in enumerate(self.procs):
            code = launched.proc.poll()
            if code is None:
                running += 1
            elif self._note_exit(i):
                ended.append((i, code))
        return running, ended

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
            self.journal.emit(s.ProcessExited(node=launched.node, pid=launched.proc.pid,
                                              returncode=launched.proc.returncode))
            return True
        mates = [i for i, p in enumerate(self.procs) if p.node == launched.node]
        if all(i in self._exited for i in mates):
            ended = [self.procs[i].proc for i in self._exited if i in mates]  # in the order they ended
            first = next((p for p in ended if p.returncode != 0), ended[-1])
            self.journal.emit(s.ProcessExited(node=launched.node, pid=first.pid, returncode=first.returncode))
        return True

    def terminate(self) -> None:
        """SIGTERM every process's group, SIGKILL those left after ``TERM_GRACE_S``; note every end."""
        self.journal.stopping_ranks = True
        for launched in self.procs:
            launched.signal(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for launched in self.procs:
            proc = launched.proc
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                launched.signal(signal.SIGKILL)
                if not isinstance(proc, RemoteProcess):
                    proc.wait()
                    continue
                try:
                    proc.wait(ap.SILENCE_S)  # another host's answer comes over the network
                except subprocess.TimeoutExpired:
                    proc.ended(proc.pid, -signal.SIGKILL)
        for i in range(len(self.procs)):
            self._note_exit(i)

    def finish(self) -> None:
        """End the fork server and the hosts' agents, if any (after :meth:`terminate`)."""
        if self.fork_server is not None:
            self.fork_server.stop()
        if self.hosts is not None:
            self.hosts.finish()

    def close(self) -> None:
        """Remove the nodes' environment files (for 'mirage exec'): they hold the token too."""
        for node in range(self.topology.num_nodes):
            try:
                os.unlink(sessions.node_env_path(self.run.path, node))
            except OSError:
                pass
