"""``--debug-rank R``: rank R stops before its program runs and waits for a debugger on a loopback port.

The Python counterpart of starting one rank under ``gdbserver``: the other
ranks run on (and wait for it where they must), and the daemon is told when
the rank stops and runs again, so that a rank sitting at a debugger's prompt
is never reported as a hang.

The debugger is pdb over a TCP connection (:class:`RemotePdb`, as the
remote-pdb package does it): ``python -m mirage_tui.debug_client
127.0.0.1:PORT`` or ``nc`` is its terminal. ``MIRAGE_DEBUGGER=debugpy`` waits
for an IDE's debugpy client instead, where debugpy is installed. pdb stops at the program's first line and again at every
``breakpoint()`` the rank reaches; ``c`` (or closing the client) lets the rank
run on, ``q`` ends it.

Runs from ``sitecustomize`` (``shim.bootstrap``), before torch is imported,
so it talks to the daemon over its fast socket itself rather than through
``shim.rank.client``.
"""

from __future__ import annotations

import importlib.util
import os
import pdb
import socket
import sys

from shim.rank.runtime import RUNTIME
from wire import schema as s
from wire.endpoints import fast_socket_path

#: Only this machine may attach: a debugger runs any code it is given in the rank.
HOST = "127.0.0.1"
#: How long the rank waits for the daemon to note its state (it answers at once unless it is gone).
DAEMON_TIMEOUT_S = 5.0


def _tell_daemon(rank: int, phase: s.DebugPhase, debugger: str, address: str, connect: str) -> None:
    """Send a ``DebuggerState`` over the daemon's fast socket and wait for its answer (no daemon: nothing)."""
    settings = RUNTIME.settings
    if not settings.has_daemon or not settings.endpoint.startswith("ipc://"):
        return
    msg = s.DebuggerState(rank=rank, node=settings.node_rank, pid=os.getpid(),
                          phase=phase, debugger=debugger, address=address, connect=connect)
    path = fast_socket_path(settings.endpoint)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(DAEMON_TIMEOUT_S)
            sock.connect(path)
            sock.send(s.encode(msg, token=settings.token, req=1))
            sock.recv(s.FAST_MAX_MESSAGE_BYTES)
    except OSError as e:  # the debugger still works; only the hang detector does not know about it
        print(f"mirage: rank {rank} could not tell the daemon it is in the debugger: {e}", file=sys.stderr,
              flush=True)


def _announce(rank: int, debugger: str, address: str, connect: str) -> None:
    """The rank's one line naming how to connect (in its log; the session shows the daemon's event too)."""
    _tell_daemon(rank, s.DebugPhase.WAITING, debugger, address, connect)
    print(f"mirage: rank {rank} (pid {os.getpid()}) waits for a debugger: {connect}", file=sys.stderr, flush=True)


class RemotePdb(pdb.Pdb):
    """pdb whose terminal is one TCP client at a time, on a loopback port kept for the process's life.

    Every stop waits for a client if none is attached; ``c``, ``q`` or the
    client closing its end hang up (the rank runs on, or with ``q`` ends), and
    the next stop waits for a client again on the same port.
    """

    def __init__(self, rank: int) -> None:
        # nosigint: SIGINT is the session's way to stop the rank, not a request to break into pdb
        super().__init__(nosigint=True)
        self.rank = rank
        self.use_rawinput = False  # read commands from the connection, not the rank's stdin
        self.prompt = f"(Pdb rank {rank}) "
        self._listener = socket.create_server((HOST, 0))
        self.address = f"{HOST}:{self._listener.getsockname()[1]}"
        self.connect = f"python -m mirage_tui.debug_client {self.address}"  # or nc, where it is installed
        self._conn: socket.socket | None = None
        self._hang_up_after = False

    def _state(self, phase: s.DebugPhase) -> None:
        _tell_daemon(self.rank, phase, "pdb", self.address, self.connect)

    def _accept(self) -> None:
        _announce(self.rank, "pdb", self.address, self.connect)
        self._conn, _ = self._listener.accept()
        # two files: one text file over both directions drops what it read ahead at every write
        self.stdin = self._conn.makefile("r", encoding="utf-8", errors="replace")
        self.stdout = self._conn.makefile("w", encoding="utf-8", errors="replace")
        self.message(f"mirage: rank {self.rank} (pid {os.getpid()}) is stopped here; 'c' lets it run on "
                     "(so does closing this connection), 'q' ends it")

    def _hang_up(self) -> None:
        """Close the client's connection; what pdb prints until the next one goes to the rank's stderr."""
        for end in (self.stdout, self.stdin, self._conn):
            try:
                end.close()
            except OSError:
                pass  # the client is gone already (what was left to send goes nowhere)
        self._conn = None
        self.stdin, self.stdout = sys.stdin, sys.stderr

    def interaction(self, frame, traceback) -> None:
        """A stop: wait for a client if none is attached, then pdb's prompt; the daemon hears of both."""
        if self._conn is None:
            self._accept()
        self._state(s.DebugPhase.PAUSED)
        try:
            super().interaction(frame, traceback)
        except OSError:  # the connection broke mid-command: the rank runs on, as if the client closed it
            self._hang_up_after = True
            self.set_continue()
        if self._hang_up_after:
            self._hang_up_after = False
            self._hang_up()
        self._state(s.DebugPhase.RUNNING)

    def do_continue(self, arg: str) -> bool | None:
        """c(ont(inue)): let the rank run on and hang up (a breakpoint it reaches waits for a client again)."""
        self._hang_up_after = True
        return super().do_continue(arg)

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        """q(uit): end the rank (pdb raises BdbQuit in it) and hang up."""
        self._hang_up_after = True
        return super().do_quit(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool | None:
        """The client closed its end: detach and let the rank run on (pdb itself would end the rank)."""
        self._hang_up_after = True
        self.set_continue()
        return 1

    def breakpoint_hook(self, *args, **kwargs) -> None:
        """``breakpoint()`` in the rank's program: stop there, as pdb's own hook does, on this connection."""
        self.set_trace(sys._getframe().f_back)


def _stop_at_main(debugger: RemotePdb):
    """A trace function that hands the first frame of ``__main__`` (the user's program) to ``debugger``."""
    def tracer(frame, event, arg):
        if event != "call" or frame.f_globals.get("__name__") != "__main__":
            return None  # nothing else is traced, not even line by line
        sys.settrace(None)
        debugger.set_trace(frame)  # stops at the program's first line
        return debugger.trace_dispatch

    return tracer


def _wait_for_debugpy(rank: int) -> None:
    """debugpy: listen, say where, and hold the rank until an IDE attaches (it stops at the IDE's breakpoints)."""
    import debugpy

    host, port = debugpy.listen((HOST, 0))
    address = f"{host}:{port}"
    _announce(rank, "debugpy", address, f"attach a debugpy client to {address} (VS Code: Python Debugger: "
                                        "Remote Attach)")
    debugpy.wait_for_client()
    _tell_daemon(rank, s.DebugPhase.RUNNING, "debugpy", address, "")


def wait_for_debugger(rank: int) -> None:
    """Make this process, rank ``rank``, wait for a debugger before its program runs (pdb, or what
    ``MIRAGE_DEBUGGER`` names)."""
    choice = RUNTIME.settings.debugger
    if choice == "debugpy" and importlib.util.find_spec("debugpy") is not None:
        _wait_for_debugpy(rank)
        return
    if choice != "pdb":
        why = "debugpy is not installed for this Python" if choice == "debugpy" else "it is not pdb or debugpy"
        print(f"mirage: MIRAGE_DEBUGGER={choice}, but {why}: rank {rank} uses pdb", file=sys.stderr, flush=True)
    debugger = RemotePdb(rank)
    sys.breakpointhook = debugger.breakpoint_hook
    sys.settrace(_stop_at_main(debugger))
