"""What a rank's process keeps while it runs, in one object: :data:`RUNTIME`.

The shim's layers (``pyproject.toml``: ``bootstrap`` over ``comm`` over
``transport`` ... over ``device`` over ``rank``) let a package import only
those below it, so the one object everyone reaches lives at the bottom, here,
and never imports upwards. It holds three kinds of thing:

- what this layer knows itself: the :class:`~shim.rank.settings.Settings`
  (every ``MIRAGE_*`` variable, read once), the daemon clients (connected on
  first use), the rank this process claimed;
- state small enough to be defined here although higher layers use it: the
  stream of posted collectives (:class:`Stream`, ``shim.transport.stream``),
  the staging slots and rank-to-rank rings of collectives in flight
  (:class:`Staging`, ``shim.transport``), the once-only acts done
  (:class:`Once`), the stacks file;
- slots for the objects of higher layers, which their modules build by
  handing :meth:`Runtime.attach` a function as they load: ``device``
  (``shim.device.state.DeviceState``: torchrun's agent reads it before any
  activation), ``allocator`` (``shim.memory.allocator.Allocator``), ``cuda``
  (``shim.cuda.api.CudaState``), ``comm`` (``shim.comm.state.CommState``);
  and ``clock`` (``shim.clock.clock.Clock``, at activation in clocked mode,
  else None). They are typed ``Any`` here because naming their classes would
  be an import upwards.

:meth:`Runtime.rebuild` makes all of it afresh from other settings, running
those functions again: what a rank forked from a process that imported the
shim needs. The shim's other module-level state is declared, with why, in
``pyproject.toml``'s ``[tool.mirage.module-state]`` (``tests/test_layering.py``).

Only the standard library at import: ``shim.bootstrap`` imports this in every
Python process of a session, before torch; the client (torch, ZeroMQ) is
imported when it is first connected.

Objects that never change after they are set (the settings, the device state,
the allocator, the clock) may be bound to locals once; the hot dispatch path
reads ``RUNTIME.clock`` as it read the module global it replaces: one global
and one attribute load.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shim.rank.settings import Settings

if TYPE_CHECKING:  # pragma: no cover - a type only; the module loads with the first connection
    from shim.rank.client import DaemonClient


class Stream:
    """The process's collectives in flight, oldest first, and the lock that posts and completes them from any
    thread (``shim.transport.stream``: one stream per process, as NCCL has one per group)."""

    __slots__ = ("lock", "pending")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: deque = deque()  # of shim.transport.stream.Pending


class Staging:
    """Staging buffers for collectives in flight together, shared by every communicator of the process.

    Slot 0 is the client's arena (used when nothing else is in flight, i.e.
    always for synchronous calls); slots 1.. are grown on demand, named
    ``...-s<slot>-g<generation>`` so that the daemon drops a slot's old mapping
    (``shim.transport.transports``).
    """

    __slots__ = ("arenas", "busy", "generation", "rings", "direct_max_bytes")

    def __init__(self) -> None:
        self.arenas: dict[int, Any] = {}  # slot -> its wire.arena.Arena
        self.busy: set[int] = set()
        self.generation = itertools.count(1)
        #: ring files of the rank-to-rank path made here, (pid, path, PeerRings), removed at exit
        #: (``shim.transport.direct``)
        self.rings: list[tuple[int, str, Any]] = []
        #: the largest collective taken rank to rank (0: off), set when shim.transport.direct loads
        self.direct_max_bytes = 0


class Once:
    """The rank's once-only acts done so far, by name: notices printed, patches applied, plans taken."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done: set[str] = set()

    def first(self, name: str) -> bool:
        """True the first time ``name`` is asked for (and never again)."""
        if name in self.done:
            return False
        self.done.add(name)
        return True


class Runtime:
    """A rank's runtime: its settings, daemon clients, claimed rank, collectives in flight, staging slots,
    once-only acts, and the objects its higher layers build (see the module docstring)."""

    __slots__ = ("settings", "device", "clock", "allocator", "cuda", "comm", "stream", "staging", "once",
                 "stacks_file", "claimed_rank", "claimed_pid", "_client", "_host_client", "_builders")

    def __init__(self, settings: Settings) -> None:
        #: what builds the higher layers' objects, in the order their modules registered (see attach)
        self._builders: list[Callable[[Runtime], None]] = []
        self._start(settings)

    def _start(self, settings: Settings) -> None:
        self.settings = settings
        #: the emulated GPUs (shim.device.state.DeviceState), built when shim.device.state loads
        self.device: Any = None
        #: clocked mode's clock (shim.clock.clock.Clock), set at activation; None in functional mode
        self.clock: Any = None
        #: the GPUs' memory model (shim.memory.allocator.Allocator), built when that module loads
        self.allocator: Any = None
        #: the torch.cuda surface's state (shim.cuda.api.CudaState): default streams, SMI, the pushed mode
        self.cuda: Any = None
        #: torch.distributed's (shim.comm.state.CommState): worlds formed, the group being made, faults
        self.comm: Any = None
        self.stream = Stream()
        self.staging = Staging()
        self.once = Once()
        #: the file faulthandler dumps stacks to (shim.rank.output), open for the process's life
        self.stacks_file: Any = None
        #: the rank this process claimed: at start-up ($RANK, else 0; shim.bootstrap) or when it formed a
        #: world of its own (shim.comm.world); None for a descendant of a rank that has not
        self.claimed_rank: int | None = None
        #: the pid that claimed it: a forked child inherits claimed_rank but is not that rank's process
        self.claimed_pid = 0
        self._client: DaemonClient | None = None
        self._host_client: DaemonClient | None = None

    def attach(self, build: Callable[[Runtime], None]) -> None:
        """Build a higher layer's objects onto this runtime now, and again whenever it is rebuilt: a module
        registers here, at import, what it would otherwise make into a module global."""
        self._builders.append(build)
        build(self)

    def rebuild(self, settings: Settings) -> None:
        """Start afresh from ``settings``: every per-rank object made again, as in a new process (a rank
        forked from a process that imported the shim; before it activates, since activation hands these
        objects to torch)."""
        self._start(settings)
        for build in self._builders:
            build(self)

    def build_again(self) -> None:
        """Build the higher layers' objects again from the environment as it is now, keeping this layer's
        (settings, claimed rank, clients): a rank forked with the shim imported does so as the shim activates,
        where a fresh process would first import those layers."""
        for build in self._builders:
            build(self)

    def claim(self, rank: int) -> None:
        """Record that this process is rank ``rank``."""
        self.claimed_rank, self.claimed_pid = rank, os.getpid()

    def has_claimed(self, rank: int) -> bool:
        """Whether this very process (not a parent it was forked from) already claimed rank ``rank``."""
        return self.claimed_rank == rank and self.claimed_pid == os.getpid()

    def _connect(self, endpoint: str, daemon_pid: int) -> DaemonClient:
        from shim.rank.client import DaemonClient

        st = self.settings
        c = DaemonClient(endpoint, st.token, st.session, f"r{os.environ.get('RANK', '0')}-p{os.getpid()}",
                         daemon_pid, server_key=st.server_key, run_dir=st.run_dir)
        # the last rank-to-rank collectives' requests reach the daemon, whose books would miss them
        atexit.register(c.flush)
        return c

    def client(self) -> DaemonClient:
        """The process's daemon client, connected on first use: the session's daemon (on the head in a
        multi-host run), which serves every communicator but those :meth:`host_client` serves."""
        c = self._client
        if c is None:
            c = self._client = self._connect(self.settings.endpoint, self.settings.daemon_pid)
        return c

    def host_client(self) -> DaemonClient | None:
        """In a multi-host run, the daemon of this host (``MIRAGE_HOST_ENDPOINT``, set by its agent), which
        serves the communicators whose members all run here, over shared memory; None on one machine."""
        if self._host_client is None and self.settings.host_endpoint:
            self._host_client = self._connect(self.settings.host_endpoint, self.settings.host_daemon_pid)
        return self._host_client

    def flush_clients(self) -> None:
        """Send every client's deferred requests (rank-to-rank collectives' books)."""
        for c in (self._client, self._host_client):
            if c is not None:
                c.flush()


#: The process's runtime: the shim's one mutable module global.
RUNTIME = Runtime(Settings.from_environ())
