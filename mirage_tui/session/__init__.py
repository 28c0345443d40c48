"""A session owns every process of one run: the daemon, the node processes, their children.

It creates the run directory, starts the daemon and waits until it answers,
starts one process per emulated node (or, with ``--nproc-per-node``, that many
rank processes per node, as torchrun would) with the environment the shim reads,
gathers every event (daemon events from ZeroMQ, output lines from the rank
files and node pipes) into one ordered stream that goes to ``events.jsonl``
and to the caller's sink, and tears everything down at the end: nodes first,
the daemon last, then anything still carrying the session's id.

The event stream, the journal and the fold are the journal's (:mod:`.journal`);
the emulator daemon, its process and sockets, are :mod:`.daemon`'s. What stands
on its own lives outside the package: the environment a process gets
(:mod:`~mirage_tui.launch_env`), starting and stopping processes
(:mod:`~mirage_tui.processes`), other hosts (:mod:`~mirage_tui.hosts`), hang
reports (:mod:`~mirage_tui.diagnosis`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from emulator import kineto_trace
from emulator import schema as s
from emulator.arena import session_segments
from emulator.daemon import endpoints
from mirage_tui import diagnosis, flight_recorder, report, rundir, sessions
from mirage_tui import agent_protocol as ap
from mirage_tui.hosts import Hosts, HostsError, RemoteProcess
from mirage_tui.launch_env import RankEnvironment, node_env, rank_env
from mirage_tui.output import pump_pipe
from mirage_tui.processes import TERM_GRACE_S, StartError, free_port, kill_carrying, signal_group, spawn
from mirage_tui.runstate import Outcome, RunState
from mirage_tui.session.daemon import LaunchError, SessionDaemon
from mirage_tui.session.journal import Journal, Sink
from mirage_tui.topology import Launcher, OnHang, Topology, UsageError, slurm_hosts
from shim.bootstrap import is_torchrun_agent

#: How long the other nodes may keep running after one failed.
FAIL_GRACE_S = 3.0
#: Exit code of a run stopped because of a hang (as coreutils' timeout uses).
HANG_EXIT = 124
#: Exit code of a run whose emulator daemon died under it (as ``docker run`` answers its daemon's failures).
DAEMON_DIED_EXIT = 125
#: Exit code of a run stopped because its run directory could not be written (sysexits' EX_IOERR).
WRITE_FAILED_EXIT = 74


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


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


class Session:
    """Run ``topology``'s command on its emulated cluster; events go to ``sink``."""

    def __init__(self, topology: Topology, sink: Sink):
        self.topology = topology
        self.run = rundir.create(topology.log_dir, sockets=not topology.in_process)
        self.journal = Journal(self.run, sink)
        self.daemon = SessionDaemon(topology, self.run, self.journal.emit)
        self.procs: list[Launched] = []  # every process started, in order: one per node, or one per rank
        self._exited: list[int] = []  # indexes into procs of the processes seen ended, in that order
        self.trace: str | None = None  # the merged trace.json of a clocked run, once closed
        self.hosts: Hosts | None = None  # a multi-host run (--launcher slurm): the hosts' agents
        self._master_addr = "127.0.0.1"  # MASTER_ADDR: this machine, or the host of node 0

    @property
    def state(self) -> RunState:
        """The fold of every event (the journal's): diagnoses, the report, the sink's reading."""
        return self.journal.state

    # ------------------------------------------------------------ events

    def _registered(self, e: s.RankRegistered) -> None:
        """A rank on another host: its agent watches the process for the daemon."""
        if self.hosts is not None and e.host and e.host != socket.gethostname():
            self.hosts.watch(e.host, e.rank, e.pid)

    # ------------------------------------------------------------ start

    def where(self) -> RankEnvironment:
        """What every launched process is told about this session (:mod:`mirage_tui.launch_env`)."""
        daemon = self.daemon
        return RankEnvironment(
            topology=self.topology, session=self.run.session, run_dir=self.run.path, token=self.run.token,
            endpoint=daemon.tcp_endpoint or endpoints(self.run.path)[0], master_addr=self._master_addr,
            server_key=daemon.server_key if daemon.tcp_endpoint else "",
            daemon_pid=daemon.proc.pid if daemon.proc is not None and not daemon.tcp_endpoint else None,
        )

    def node_env(self, node: int, master_port: int) -> dict[str, str]:
        """The environment node process ``node`` starts with (:func:`mirage_tui.launch_env.node_env`)."""
        return node_env(self.where(), node, master_port)

    def rank_env(self, node: int, local_rank: int, master_port: int) -> dict[str, str]:
        """The environment of rank ``local_rank`` of node ``node`` (:func:`mirage_tui.launch_env.rank_env`)."""
        return rank_env(self.where(), node, local_rank, master_port)

    def _launch(self, node: int, rank: int | None, env: dict[str, str]) -> None:
        """Start the command as node ``node``'s process, or as its rank ``rank``; track it at once
        (:func:`mirage_tui.processes.spawn`: a rank's output goes to its rank files, a node's to pipes)."""
        topo = self.topology
        try:
            proc = spawn(topo.command, env, topo.workdir, self.run.ranks, rank)
        except StartError as e:
            raise LaunchError(str(e), e.returncode) from None
        self.procs.append(Launched(proc, node, rank))
        if rank is None:
            self.journal.fed_by(pump_pipe(proc.stdout, node, s.Stream.STDOUT, self.journal.emit))
            self.journal.fed_by(pump_pipe(proc.stderr, node, s.Stream.STDERR, self.journal.emit))

    def start(self) -> None:
        """Start the daemon (unless in-process), the event pumps and the node processes."""
        try:  # so that 'mirage sessions' and 'mirage-tui --attach' find the run
            sessions.register(self.run.session, self.run.path, self.topology)
        except (OSError, UsageError) as e:
            print(f"mirage: this run is not listed in 'mirage sessions': {e}", file=sys.stderr)
        self.journal.start()
        if not self.topology.in_process:
            self.daemon.start()
            self.journal.feed(self.daemon.pump_events, "daemon-events")
        self.journal.feed(self.journal.follow_rank_files, "rank-output")
        if self.topology.launcher is Launcher.SLURM:
            return self._start_on_hosts()
        port = free_port()
        for node in range(self.topology.num_nodes):  # for 'mirage exec SESSION --node N'
            sessions.write_node_env(self.run.path, node, self.node_env(node, port))
        nproc = self.topology.nproc_per_node
        for node in range(self.topology.num_nodes):
            if nproc is None:
                self._launch(node, None, self.node_env(node, port))
                continue
            for local in range(nproc):
                self._launch(node, node * nproc + local, self.rank_env(node, local, port))

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

    # ------------------------------------------------------------ wait / stop

    def wait(self) -> Outcome:
        """Block until every process exited (or one failed and the rest were stopped)."""
        first_failure: tuple[int, int] | None = None
        failed_at = 0.0
        daemon = self.daemon.proc
        while True:
            running = 0
            self.journal.check_space()
            if self.journal.write_error is not None:  # the disk is full: stop now rather than lose output silently
                self._terminate_nodes()
                return Outcome(
                    WRITE_FAILED_EXIT,
                    f"could not write the run directory ({self.journal.write_error}); the run was stopped so "
                    f"that no output is lost silently",
                    self.run.path,
                )
            # before the nodes: ranks fail fast once the daemon is gone, and its death is the cause
            if daemon is not None and daemon.poll() is not None and first_failure is None:
                first_failure, failed_at = (-1, daemon.returncode), time.monotonic()
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
                f"the mirage daemon (pid {daemon.pid}) {how} during the run; see {self.run.path}/daemon.log",
                self.run.path,
            )
        self.journal.settle()  # the summary reads the fold: which rank the daemon saw go first
        return Outcome(code if code > 0 else 128 - code, self._failure_summary(index, code), self.run.path)

    def _report_hangs(self) -> str | None:
        """Diagnose every hang the daemon reported since the last call; return a summary of the first."""
        summary = None
        while (finding := self.journal.next_hang()) is not None:
            label = self.state.comm_label(finding.comm)
            ranks = dict(self.state.ranks)  # a copy: the dispatcher adds ranks meanwhile
            rank_hosts = {r: status.host for r, status in ranks.items() if status.host}
            d = diagnosis.diagnose(
                finding, dict(self.state.rank_pids), dict(self.state.last_output), self.run.ranks, self.run.session,
                label, rank_hosts, None if self.hosts is None else self.hosts.remote_stacks,
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
            self.journal.emit(s.HangReport(comm=finding.comm, seq=finding.seq, text=text, path=path))
            missing = ", ".join(map(str, finding.missing))
            if self.hosts is not None:  # several hosts: say where the missing ones run
                missing = ", ".join(f"{r} on {rank_hosts[r]}" if rank_hosts.get(r) else str(r)
                                    for r in finding.missing)
            what = (f"world formation (init_process_group) of {finding.comm}" if finding.kind is s.HangKind.WORLD
                    else f"collective #{finding.seq} ({finding.op.name}) of {label}")
            summary = summary or f"hang in {what}: missing ranks {{{missing}}}; report: {path}"
        return summary

    def _failure_summary(self, index: int, code: int) -> str:
        """Who failed first (``procs[index]``) and how, then which ranks raised (and where their logs are)."""
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        launched = self.procs[index]
        node, pid = launched.node, launched.proc.pid
        if isinstance(launched.proc, RemoteProcess) and launched.proc.agent.lost:
            agent = launched.proc.agent
            ranks = ", ".join(map(str, sorted(agent.ranks))) or "none registered yet"
            nodes = ", ".join(map(str, agent.nodes))
            return (f"host {agent.host} was lost ({agent.lost}); it ran node(s) {nodes}, ranks {{{ranks}}}; "
                    f"its output up to then is in {self.run.path}/rank-*.log")
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
            self.journal.emit(s.ProcessExited(node=launched.node, pid=launched.proc.pid,
                                              returncode=launched.proc.returncode))
            return True
        mates = [i for i, p in enumerate(self.procs) if p.node == launched.node]
        if all(i in self._exited for i in mates):
            ended = [self.procs[i].proc for i in self._exited if i in mates]  # in the order they ended
            first = next((p for p in ended if p.returncode != 0), ended[-1])
            self.journal.emit(s.ProcessExited(node=launched.node, pid=first.pid, returncode=first.returncode))
        return True

    def _terminate_nodes(self) -> None:
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

    def _sweep(self) -> None:
        """Kill anything still carrying this session's id (escaped process groups)."""
        kill_carrying(MIRAGE_SESSION=self.run.session)
        for path in session_segments(self.run.session):
            try:
                os.unlink(path)
            except OSError:
                pass

    def stop(self) -> None:
        """Tear down: nodes, then the hosts' agents, then the daemon, then stragglers; drain the event pumps."""
        self._terminate_nodes()
        if self.hosts is not None:
            self.hosts.finish()
        self.daemon.stop()
        self._sweep()
        self.journal.drain()

    def close(self, outcome: Outcome | None) -> None:
        """Record the end, close the journal, write the report and remove the secrets (after :meth:`stop`)."""
        self.journal.close(outcome)
        report.write(self.state, self.topology, outcome, self.run)
        self.trace = kineto_trace.merge_traces(self.run.path)  # the ranks' traces/rank-R.json, if any
        self.daemon.close()
        try:
            os.unlink(self.run.token_file)  # useless once the daemon is gone
        except OSError:
            pass
        for node in range(self.topology.num_nodes):  # they hold the token too
            try:
                os.unlink(sessions.node_env_path(self.run.path, node))
            except OSError:
                pass
        sessions.unregister(self.run.session)

