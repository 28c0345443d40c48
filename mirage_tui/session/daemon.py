"""The session's emulator daemon: its process, the ZeroMQ context the session reaches it with, its events.

The session starts it before any rank (:meth:`SessionDaemon.start` returns once it answered and its
``daemon_ready`` reached the session's SUB socket) and pumps its events into the journal
(:meth:`SessionDaemon.pump_events`). In a multi-host run (``--launcher slurm``) it also listens on TCP on
the chosen interface, CURVE-encrypted: this holds that address, its public key and its secret key's file,
which the hosts' agents are given. :class:`LaunchError` is here, with the first process a session starts;
the launcher raises it too.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable

import zmq

from mirage_tui.config.launch_env import BOOT_DIR
from mirage_tui.config.rundir import RunDir
from mirage_tui.config.topology import Launcher, Topology, UsageError
from mirage_tui.hosts import netif
from mirage_tui.hosts.daemon_proc import DaemonSettings, DaemonStartError, start_daemon
from mirage_tui.hosts.processes import stop_child
from wire import schema as s
from wire.endpoints import TCP_ENDPOINT_FILE, endpoints


class LaunchError(Exception):
    """The session could not start (command missing, daemon not answering)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


class SessionDaemon:
    """The daemon serving ``run`` for ``topology``; its events go to ``emit``."""

    def __init__(self, topology: Topology, run: RunDir, emit: Callable[[s.Event, bytes | None], None]):
        self.topology = topology
        self.run = run
        self.emit = emit
        self._ctx = zmq.Context()
        self.proc: subprocess.Popen | None = None
        self._sub: zmq.Socket | None = None  # where its events arrive, once it started
        # a multi-host run (--launcher slurm): the address it also listens on, its public key, its TCP endpoint
        self.address = ""
        self.server_key = ""
        self.tcp_endpoint = ""
        self.secret_file = os.path.join(run.path, "curve.secret")

    def start(self) -> None:
        """Start the daemon and wait until it serves; its ready event is the first it emits."""
        try:
            started = start_daemon(self._ctx, self.run.path, self.run.session, self.run.token, self.run.token_file,
                                   self.settings(), self.env(),
                                   os.path.join(self.run.path, "daemon.log"), self._listen_args())
        except DaemonStartError as e:
            raise LaunchError(str(e), 1) from None
        self.proc, self._sub = started.proc, started.events
        self.emit(started.ready, None)
        if self.address:
            with open(os.path.join(self.run.path, TCP_ENDPOINT_FILE)) as f:
                self.tcp_endpoint = f.read().strip()

    def settings(self) -> DaemonSettings:
        """What the run's daemons are told: the session's, and in a multi-host run each host's."""
        topo = self.topology
        return DaemonSettings(topo.profile, topo.num_nodes, topo.gpus_per_node, topo.hang_timeout_s,
                              topo.exec_mode.value)

    def _listen_args(self) -> list[str]:
        """A multi-host run's daemon also listens on the chosen interface, CURVE-encrypted (its secret key
        in a 0600 file of the run directory, removed with the token)."""
        if self.topology.launcher is not Launcher.SLURM:
            return []
        try:
            _, self.address = netif.choose()
        except UsageError as e:
            raise LaunchError(str(e), 2) from None
        public, secret = zmq.curve_keypair()
        self.server_key = public.decode()
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        return ["--listen", self.address, "--curve-secret-file", self.secret_file]

    def env(self) -> dict[str, str]:
        """The environment a daemon starts with, here or on another host."""
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(BOOT_DIR))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["MIRAGE_SESSION"] = self.run.session  # tags it for the orphan sweep
        return env

    def pump_events(self, stopping: threading.Event) -> None:
        """Emit the daemon's events as they arrive, until ``stopping`` is set and they are all read."""
        while True:
            stopping_now = stopping.is_set()  # read before draining, so the last drain is complete
            if self._sub.poll(0 if stopping_now else 100):
                while True:
                    try:
                        data = self._sub.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for event, line in s.iter_events(data.split(b"\n")):
                        self.emit(event, line)
            if stopping_now:
                return

    def rank_exited(self, host: str, rank: int, pid: int) -> None:
        """Tell the daemon that rank ``rank``'s process on ``host`` is gone (it sees only this host's)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoints(self.run.path)[0])
            dealer.send(s.encode(s.RankExited(token=self.run.token, rank=rank, pid=pid, host=host)))
            dealer.poll(1000)  # answered Ok once recorded
        finally:
            dealer.close(0)

    def stop(self) -> None:
        """Stop the daemon, if it started."""
        if self.proc is not None:
            stop_child(self.proc)

    def close(self) -> None:
        """Let go of ZeroMQ and of the secret key, useless once the daemon is gone (after :meth:`stop`)."""
        self._ctx.destroy(linger=0)
        try:
            os.unlink(self.secret_file)
        except OSError:
            pass
