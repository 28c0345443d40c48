"""Live sessions: the registry that lets ``mirage sessions``, ``stop`` and ``mirage-tui --attach`` find a run.

Every session writes ``session.json`` into its run directory when it starts and
a copy into the user's registry folder (:func:`registry_dir`), and removes the
copy when it ends. An entry whose owner process is gone (a SIGKILLed
``mirage run``) stays behind until ``mirage cleanup`` removes it: such a session
is listed as *dead*. No Textual here: batch mode and the CLI read it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field

import psutil

from mirage_tui.config.topology import Topology, UsageError
from mirage_tui.state.runstate import RunState

#: The run directory's copy of its entry.
SESSION_FILE = "session.json"


def registry_dir() -> str:
    """This user's registry folder: ``$XDG_RUNTIME_DIR/mirage/sessions``, else ``<tmp>/mirage-<uid>/sessions``.

    Made 0700 on first use; a folder another user owns (someone made it first in /tmp) is refused.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        root = os.path.join(runtime, "mirage")
    else:
        root = os.path.join(tempfile.gettempdir(), f"mirage-{os.getuid()}")
    path = os.path.join(root, "sessions")
    for folder in (root, path):  # one at a time: makedirs gives the parents the umask's mode, not 0700
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
    for folder in (root, path):
        st = os.lstat(folder)
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077:
            raise UsageError(f"the session registry {folder} must be a folder of yours that only you can read "
                             f"(mode 0700); remove it and try again")
    return path


@dataclass(frozen=True)
class SessionEntry:
    """One session as it registered: who owns it, where it writes, what it runs."""

    session: str  # the run's short hex id (names its shared memory, tags its processes)
    run_dir: str
    pid: int  # the owner: the `mirage run` / `mirage-tui` process that reaps the run
    pid_started: float  # the owner's start time (psutil), so a reused pid is not taken for it
    started: float  # time.time() at registration
    host: str
    profile: str
    num_nodes: int
    gpus_per_node: int
    exec_mode: str
    command: tuple[str, ...] = field(default_factory=tuple)

    @property
    def alive(self) -> bool:
        """Whether the owner process is still running (the same process, not one that got its pid)."""
        try:
            owner = psutil.Process(self.pid)
            # a zombie has ended (its parent, a shell or a test, has not reaped it yet)
            return (abs(owner.create_time() - self.pid_started) < 1.0
                    and owner.status() != psutil.STATUS_ZOMBIE)
        except (psutil.Error, OSError):
            return False

    def to_json(self) -> dict:
        """The entry as its file holds it."""
        return {**asdict(self), "command": list(self.command)}

    @classmethod
    def from_json(cls, data: dict) -> SessionEntry:
        """An entry from its file's object; ValueError if a field is missing or of the wrong type."""
        try:
            entry = cls(**{**data, "command": tuple(data.get("command", ()))})
        except TypeError as e:
            raise ValueError(str(e)) from None
        checks = (("session", str), ("run_dir", str), ("pid", int), ("num_nodes", int), ("gpus_per_node", int))
        for name, kind in checks:
            if not isinstance(getattr(entry, name), kind):
                raise ValueError(f"{name} is not a {kind.__name__}")
        return entry


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def register(session: str, run_dir: str, topology: Topology) -> SessionEntry:
    """Record a starting session (this process owns it) in its run directory and the registry."""
    me = psutil.Process()
    entry = SessionEntry(
        session=session, run_dir=os.path.abspath(run_dir), pid=me.pid, pid_started=me.create_time(),
        started=time.time(), host=socket.gethostname(), profile=topology.profile, num_nodes=topology.num_nodes,
        gpus_per_node=topology.gpus_per_node, exec_mode=topology.exec_mode.value, command=tuple(topology.command),
    )
    _write_json(os.path.join(run_dir, SESSION_FILE), entry.to_json())
    _write_json(os.path.join(registry_dir(), f"{session}.json"), entry.to_json())
    return entry


def node_env_path(run_dir: str, node: int) -> str:
    """Where a session keeps node ``node``'s environment (for ``mirage exec``)."""
    return os.path.join(run_dir, f"node-{node}.env.json")


def write_node_env(run_dir: str, node: int, env: dict[str, str]) -> None:
    """Keep the environment node ``node`` starts with; private to the user (it holds the session token)."""
    _write_json(node_env_path(run_dir, node), env)


def read_node_env(entry: SessionEntry, node: int) -> dict[str, str]:
    """Node ``node``'s environment in ``entry``'s session; :class:`UsageError` for a node it does not have."""
    if not 0 <= node < entry.num_nodes:
        raise UsageError(f"--node must be 0-{entry.num_nodes - 1} (session {entry.session} has "
                         f"{entry.num_nodes} node(s)), got {node}")
    try:
        with open(node_env_path(entry.run_dir, node), encoding="utf-8") as f:
            env = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"session {entry.session} kept no environment for node {node}: {e}") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError(f"{node_env_path(entry.run_dir, node)} is not an environment (an object of strings)")
    return env


def unregister(session: str) -> None:
    """The session ended: drop it from the registry (its run directory keeps ``session.json``)."""
    try:
        os.unlink(os.path.join(registry_dir(), f"{session}.json"))
    except (OSError, UsageError):
        pass


def entries() -> list[SessionEntry]:
    """Every registered session, live or dead, oldest first; unreadable entry files are skipped."""
    folder = registry_dir()
    out = []
    for name in os.listdir(folder):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out.append(SessionEntry.from_json(json.load(f)))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: e.started)


def live() -> list[SessionEntry]:
    """The registered sessions whose owner still runs."""
    return [e for e in entries() if e.alive]


def read_entry(run_dir: str) -> SessionEntry:
    """The entry a run directory keeps; :class:`UsageError` if it has none."""
    path = os.path.join(run_dir, SESSION_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return SessionEntry.from_json(json.load(f))
    except FileNotFoundError:
        raise UsageError(f"{run_dir} is not a mirage run directory of a session (it has no {SESSION_FILE})") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} cannot be read: {e}") from None


def find(what: str | None) -> SessionEntry:
    """The live session ``what`` names: its id (or a unique prefix of it) or its run directory.

    ``None``: the only live session. :class:`UsageError` (one line) when none or several match, or
    when the session named has ended.
    """
    running = live()
    if what is None:
        if len(running) == 1:
            return running[0]
        if not running:
            raise UsageError("no live mirage session on this machine (start one with 'mirage run')")
        ids = ", ".join(e.session for e in running)
        raise UsageError(f"{len(running)} live sessions ({ids}): name one")
    if os.path.isdir(what):
        entry = read_entry(what)
        if not entry.alive:
            raise UsageError(f"the session of {what} ({entry.session}) has ended; "
                             f"'mirage-tui --replay {what}' plays it back")
        return entry
    matches = [e for e in running if e.session.startswith(what)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise UsageError(f"session {what!r} is ambiguous: {', '.join(e.session for e in matches)}")
    ended = [e for e in entries() if e.session.startswith(what)]
    if ended:
        raise UsageError(f"session {ended[0].session} is not live (its owner, pid {ended[0].pid}, is gone; "
                         f"'mirage cleanup' removes what it left)")
    known = ", ".join(e.session for e in running) or "none"
    raise UsageError(f"no live session {what!r} (live: {known}; 'mirage sessions' lists them)")


def run_state(entry: SessionEntry) -> str:
    """``running``, ``in collective`` or ``hung``: what the session's journal says now."""
    state = RunState.from_journal(os.path.join(entry.run_dir, "events.jsonl"))
    ranks = [state.rank_state(rank) for rank in state.registered]
    if state.hang_reports or any(r in ("stuck", "missing") for r in ranks):
        return "hung"
    if any(r == "in collective" for r in ranks):
        return "in collective"
    return "running" if ranks else "starting"


def stop(entry: SessionEntry, timeout: float = 60.0) -> bool:
    """End ``entry``'s session as Ctrl-C would (SIGINT to its owner); True once the owner is gone."""
    if not entry.alive:
        return True
    try:
        os.kill(entry.pid, signal.SIGINT)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while entry.alive:  # not psutil's wait: the owner is not our child, and may stay a zombie a while
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
