"""Starting an emulator daemon (``python -m emulator``) and waiting until it serves.

The session starts one for its run; in a multi-host run each host's agent
(:mod:`mirage_tui.hosts.agent`) starts one more for the communicators whose
members all run on that host. Both wait the same way: the daemon is ready once
a ping is answered and its ``DaemonReady`` reached the caller's SUB socket
(before that, ZeroMQ may drop events: the slow-joiner window).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass

import zmq

from wire import schema as s
from wire.endpoints import endpoints

#: How long a daemon has to answer its first ping.
START_TIMEOUT_S = 20.0


class DaemonStartError(Exception):
    """The daemon exited or did not answer in time (the message says which, and where its log is)."""


@dataclass(frozen=True)
class DaemonSettings:
    """What a daemon is told about the run: the same for the session's and every host's."""

    profile: str
    nodes: int
    gpus_per_node: int
    hang_timeout_s: float
    exec_mode: str  # "functional", "clocked" or "estimate"

    def args(self) -> list[str]:
        """These settings as ``python -m emulator`` flags (``mirage_tui.hosts.agent`` takes the same: :meth:`parse`)."""
        return ["--profile", self.profile, "--nodes", str(self.nodes), "--gpus-per-node", str(self.gpus_per_node),
                "--hang-timeout", str(self.hang_timeout_s), "--exec-mode", self.exec_mode]

    @classmethod
    def parse(cls, argv: list[str] | None, prog: str) -> DaemonSettings:
        """The settings :meth:`args` wrote (a host's agent reads them from its command line)."""
        p = argparse.ArgumentParser(prog=prog)
        p.add_argument("--profile", required=True)
        p.add_argument("--nodes", type=int, required=True)
        p.add_argument("--gpus-per-node", type=int, required=True)
        p.add_argument("--hang-timeout", type=float, required=True)
        p.add_argument("--exec-mode", choices=["functional", "clocked", "estimate"], required=True)
        a = p.parse_args(argv)
        return cls(a.profile, a.nodes, a.gpus_per_node, a.hang_timeout, a.exec_mode)


@dataclass
class StartedDaemon:
    """A daemon that answered: its process, the SUB socket its events arrive on, and its ready event."""

    proc: subprocess.Popen
    events: zmq.Socket
    ready: s.DaemonReady


def start_daemon(ctx: zmq.Context, run_dir: str, session: str, token: str, token_file: str,
                 settings: DaemonSettings, env: dict[str, str], log_path: str,
                 extra_args: list[str] | None = None) -> StartedDaemon:
    """Start a daemon serving ``run_dir`` (its sockets there) and return it once it serves."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "emulator", "--run-dir", run_dir, "--session", session, "--token-file", token_file,
             *settings.args(), *(extra_args or [])],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
        )
    rpc, events = endpoints(run_dir)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)  # events are never dropped
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rpc)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DaemonStartError(f"the mirage daemon exited with code {proc.returncode}; see {log_path}")
            dealer.send(s.encode(s.Ping(token=token)))
            if not (dealer.poll(200) and isinstance(s.decode(dealer.recv()), s.Ok)):
                continue
            while sub.poll(200):
                for event in s.decode_events(sub.recv()):
                    if isinstance(event, s.DaemonReady):
                        return StartedDaemon(proc, sub, event)
        raise DaemonStartError(f"the mirage daemon did not answer within {START_TIMEOUT_S:.0f} s; see {log_path}")
    except DaemonStartError:
        sub.close(0)
        proc.kill()
        proc.wait()
        raise
    finally:
        dealer.close(0)
