"""A run's life, start to end: :class:`Session` starts its parts in order, waits for the end and tears down.

The parts own the state: the journal (:mod:`.journal`) the events and the fold, the daemon
(:mod:`.daemon`) its process and sockets, the launcher (:mod:`.launcher`) the command's processes.
What is here acts across them: how a run ends and what its outcome says (the first failure after the
others' grace, a hang, the daemon's death, a full disk), and the teardown's order — nodes first, the
daemon last, then anything still carrying the session's id.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from mirage_tui.config import rundir
from mirage_tui.config.topology import OnHang, Topology, UsageError
from mirage_tui.hosts.head import RemoteProcess
from mirage_tui.hosts.processes import kill_carrying
from mirage_tui.reports import diagnosis, flight_recorder, report
from mirage_tui.session import registry as sessions
from mirage_tui.session.daemon import SessionDaemon
from mirage_tui.session.journal import Journal, Sink
from mirage_tui.session.launcher import NodeLauncher
from mirage_tui.state.runstate import Outcome, RunState
from shim.bootstrap import is_torchrun_agent
from wire import kineto_trace
from wire import schema as s
from wire.arena import session_segments

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


class Session:
    """Run ``topology``'s command on its emulated cluster; events go to ``sink``."""

    def __init__(self, topology: Topology, sink: Sink):
        self.topology = topology
        self.run = rundir.create(topology.log_dir, sockets=not topology.in_process)
        self.journal = Journal(self.run, sink)
        self.daemon = SessionDaemon(topology, self.run, self.journal.emit)
        self.launcher = NodeLauncher(topology, self.run, self.daemon, self.journal)
        self.trace: str | None = None  # the merged trace.json of a clocked run, once closed

    @property
    def state(self) -> RunState:
        """The fold of every event (the journal's): diagnoses, the report, the sink's reading."""
        return self.journal.state

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
        self.launcher.start()

    def wait(self) -> Outcome:
        """Block until every process exited (or one failed and the rest were stopped)."""
        first_failure: tuple[int, int] | None = None
        failed_at = 0.0
        daemon = self.daemon.proc
        while True:
            self.journal.check_space()
            if self.journal.write_error is not None:  # the disk is full: stop now rather than lose output silently
                self.launcher.terminate()
                return Outcome(
                    WRITE_FAILED_EXIT,
                    f"could not write the run directory ({self.journal.write_error}); the run was stopped so "
                    f"that no output is lost silently",
                    self.run.path,
                )
            # before the nodes: ranks fail fast once the daemon is gone, and its death is the cause
            if daemon is not None and daemon.poll() is not None and first_failure is None:
                first_failure, failed_at = (-1, daemon.returncode), time.monotonic()
            running, ended = self.launcher.poll()
            for index, code in ended:
                if code != 0 and first_failure is None:
                    first_failure, failed_at = (index, code), time.monotonic()
            if not running:
                break
            if first_failure and time.monotonic() - failed_at > FAIL_GRACE_S:
                self.launcher.terminate()
            hang = self._report_hangs()
            if hang is not None and self.topology.on_hang is OnHang.EXIT:
                self.launcher.terminate()
                return Outcome(HANG_EXIT, hang, self.run.path)
            time.sleep(0.05)
        if first_failure is None:
            kind = "node" if self.topology.nproc_per_node is None else "rank"
            return Outcome(0, f"all {len(self.launcher.procs)} {kind} process(es) exited 0", self.run.path)
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
        hosts = self.launcher.hosts
        while (finding := self.journal.next_hang()) is not None:
            label = self.state.comm_label(finding.comm)
            ranks = dict(self.state.ranks)  # a copy: the dispatcher adds ranks meanwhile
            rank_hosts = {r: status.host for r, status in ranks.items() if status.host}
            d = diagnosis.diagnose(
                finding, dict(self.state.rank_pids), dict(self.state.last_output), self.run.ranks, self.run.session,
                label, rank_hosts, None if hosts is None else hosts.remote_stacks,
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
            if hosts is not None:  # several hosts: say where the missing ones run
                missing = ", ".join(f"{r} on {rank_hosts[r]}" if rank_hosts.get(r) else str(r)
                                    for r in finding.missing)
            what = (f"world formation (init_process_group) of {finding.comm}" if finding.kind is s.HangKind.WORLD
                    else f"collective #{finding.seq} ({finding.op.name}) of {label}")
            summary = summary or f"hang in {what}: missing ranks {{{missing}}}; report: {path}"
        return summary

    def _failure_summary(self, index: int, code: int) -> str:
        """Who failed first (``procs[index]``) and how, then which ranks raised (and where their logs are)."""
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        launched = self.launcher.procs[index]
        node, pid = launched.node, launched.proc.pid
        if isinstance(launched.proc, RemoteProcess) and launched.proc.agent.lost:
            agent = launched.proc.agent
            ranks = ", ".join(map(str, sorted(agent.ranks))) or "none registered yet"
            nodes = ", ".join(map(str, agent.nodes))
            return (f"host {agent.host} was lost ({agent.lost}); it ran node(s) {nodes}, ranks {{{ranks}}}; "
                    f"its output up to then is in {self.run.path}/rank-*.log")
        # with direct launch the node process is the rank itself; with --nproc-per-node mirage knows its rank
        who = next((f"rank {r}" for r, p in self.state.launched_pids.items() if p == pid), f"node {node}")
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
        self.launcher.terminate()
        self.launcher.finish()
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
        self.launcher.close()
        sessions.unregister(self.run.session)
