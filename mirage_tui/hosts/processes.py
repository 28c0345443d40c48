"""Starting and stopping a run's programs: what the session does on its host and each agent on its own.

A program starts in a session (process group) of its own, so that stopping it
reaches whatever it started (torchrun's workers); it gets SIGTERM from the
kernel if its starter dies, even by SIGKILL; a rank's stdout and stderr are its
rank files from the start (the kernel writes them, as the shim's capture would),
so a program that is not Python, or prints before the shim takes over, is still
that rank's. A node's are pipes, read as ``[node<n>]`` lines.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

import psutil

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not import or load anything
_PR_SET_PDEATHSIG = 1
#: How long a process gets between SIGTERM and SIGKILL.
TERM_GRACE_S = 3.0


class StartError(Exception):
    """The command could not be started; ``returncode`` is what the run exits with (127: not found)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def die_with_starter():
    """A pre-exec hook: the process gets SIGTERM from the kernel if its starter dies, even by SIGKILL.

    Teardown covers every other ending; this covers the one where no code of ours runs. (Ranks that
    registered with the daemon are also stopped by it; this reaches processes that never did.)
    """
    parent = os.getpid()

    def hook() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the starter died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def spawn(command: Sequence[str], env: dict[str, str], workdir: str | None, ranks_dir: str,
          rank: int | None) -> subprocess.Popen:
    """Start ``command`` as a node's process (``rank`` None: output on pipes) or as rank ``rank``."""
    if rank is None:
        out: int = subprocess.PIPE
        err: int = subprocess.PIPE
    else:
        out, err = (os.open(os.path.join(ranks_dir, f"rank-{rank}.{stream}"),
                            os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for stream in ("stdout", "stderr"))
    try:
        return subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
            cwd=workdir or None, start_new_session=True, preexec_fn=die_with_starter(),
        )
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        what = "not found" if isinstance(e, FileNotFoundError) else "not executable"
        if workdir and not os.path.isdir(workdir):
            raise StartError(f"--workdir {workdir}: no such directory", 2) from None
        raise StartError(f"command {what}: {command[0]} (searched PATH)", 127) from None
    finally:
        if rank is not None:
            os.close(out)
            os.close(err)


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (the group too when its leader is gone: a dead
    torchrun agent leaves workers)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM every process's group, wait up to ``grace_s`` in all, then SIGKILL the groups still there."""
    for proc in procs:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_child(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM a child that shares our process group (a daemon), then SIGKILL it after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (for a rendezvous the program binds later)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def kill_carrying(**env: str) -> None:
    """SIGKILL every process (but this one) whose environment has all of ``env``: what escaped its process
    group still carries the variables it was started with."""
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            theirs = p.environ()
            if all(theirs.get(k) == v for k, v in env.items()):
                p.kill()
        except (psutil.Error, OSError):
            continue
