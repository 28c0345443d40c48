"""``mirage cleanup``: remove what sessions whose owner was killed left behind.

A ``mirage run`` that is SIGKILLed cannot tear its run down. Its ranks and
daemon die with it (each has PR_SET_PDEATHSIG), but a process that escaped that
(a grandchild a rank started, a node process of a launcher that forked again),
its shared-memory segments, its sockets and its run directory's missing end
remain, and its registry entry stays (``mirage sessions --all`` lists it as
dead). Only sessions the registry knows are dead are touched: a live session,
or one another registry (another ``XDG_RUNTIME_DIR``) holds, never is.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import psutil

from mirage_tui.config import rundir
from mirage_tui.config.topology import ExecMode, Topology
from mirage_tui.hosts.fork_server import SOCKET_NAME as FORK_SERVER_SOCKET
from mirage_tui.reports import report
from mirage_tui.session import registry as sessions
from mirage_tui.state.runstate import Outcome, RunState
from wire import schema as s
from wire.arena import session_segments
from wire.endpoints import EVENT_SOCKET, FAST_SOCKET, RPC_SOCKET

#: The exit code recorded for a session whose owner was killed (as a shell reports SIGKILL).
KILLED_EXIT = 128 + signal.SIGKILL
_SOCKETS = (RPC_SOCKET, EVENT_SOCKET, FAST_SOCKET, FORK_SERVER_SOCKET)


@dataclass(frozen=True)
class Leftover:
    """One thing a dead session left: ``kind`` process, shared memory, socket, token, run end, or registry entry."""

    session: str
    kind: str
    what: str  # a path, or "pid N: its command line"
    pid: int = 0

    def __str__(self) -> str:
        return f"{self.session}  {self.kind:<14} {self.what}"


def _processes(dead: set[str]) -> list[Leftover]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if p.pid == os.getpid() or p.info["uids"] is None or p.info["uids"].real != os.getuid():
                continue
            session = p.environ().get("MIRAGE_SESSION")
        except (psutil.Error, OSError):
            continue
        if session in dead:
            command = " ".join(p.info["cmdline"] or [])[:160]
            out.append(Leftover(session, "process", f"pid {p.pid}: {command}", p.pid))
    return out


def find() -> list[Leftover]:
    """Everything the dead sessions of this user's registry left, each session's items together."""
    dead = [e for e in sessions.entries() if not e.alive]
    items = _processes({e.session for e in dead})
    for e in dead:
        items += [Leftover(e.session, "shared memory", path) for path in session_segments(e.session)]
        for name in _SOCKETS:
            path = os.path.join(e.run_dir, name)
            if os.path.lexists(path):
                items.append(Leftover(e.session, "socket", path))
        secrets = ["token", *(os.path.basename(sessions.node_env_path(e.run_dir, n)) for n in range(e.num_nodes))]
        items += [Leftover(e.session, "token", os.path.join(e.run_dir, name)) for name in secrets
                  if os.path.lexists(os.path.join(e.run_dir, name))]
        if os.path.isdir(e.run_dir) and not os.path.exists(os.path.join(e.run_dir, "report.json")):
            items.append(Leftover(e.session, "run end", f"{e.run_dir}: no report.json, no recorded end"))
        items.append(Leftover(e.session, "registry entry", os.path.join(sessions.registry_dir(), f"{e.session}.json")))
    order = {e.session: i for i, e in enumerate(dead)}
    return sorted(items, key=lambda x: order.get(x.session, -1))


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, its parent not told yet
    except psutil.NoSuchProcess:
        return True


def _end_run(entry: sessions.SessionEntry) -> None:
    """Record the end the owner could not: a ``session_ended`` event and the report, from the journal."""
    outcome = Outcome(KILLED_EXIT, f"the session's owner (pid {entry.pid}) was killed; 'mirage cleanup' "
                                   f"recorded this end", entry.run_dir)
    events = os.path.join(entry.run_dir, "events.jsonl")
    with open(events, "ab") as f:
        f.write(s.encode(s.SessionEnded(t=time.time(), returncode=outcome.returncode, summary=outcome.summary))
                + b"\n")
    topology = Topology(profile=entry.profile, num_nodes=entry.num_nodes, gpus_per_node=entry.gpus_per_node,
                        exec_mode=ExecMode(entry.exec_mode), command=entry.command)
    run = rundir.RunDir(path=entry.run_dir, session=entry.session, token="")
    report.write(RunState.from_journal(events), topology, outcome, run)


def remove(items: list[Leftover]) -> list[tuple[Leftover, str | None]]:
    """Remove each item (processes first: SIGTERM, then SIGKILL after 3 s); each with its error, or None."""
    results: list[tuple[Leftover, str | None]] = []
    procs = []
    for item in items:
        if item.kind == "process":
            try:
                proc = psutil.Process(item.pid)
                proc.terminate()
                procs.append((item, proc))
            except psutil.NoSuchProcess:
                results.append((item, None))  # gone meanwhile
            except psutil.Error as e:
                results.append((item, str(e)))
    _, alive = psutil.wait_procs([p for _, p in procs], timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=3)
    results += [(item, None if _gone(proc) else "still running") for item, proc in procs]
    entries = {e.session: e for e in sessions.entries()}
    for item in items:
        if item.kind == "process":
            continue
        try:
            if item.kind == "run end":
                _end_run(entries[item.session])
            else:
                os.unlink(item.what)
            results.append((item, None))
        except FileNotFoundError:
            results.append((item, None))
        except (OSError, KeyError, ValueError) as e:
            results.append((item, str(e)))
    return results
