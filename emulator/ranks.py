"""The daemon's books of rank processes: which process is each rank, and whether it still lives.

A rank registers its process with ``Hello`` (the last registration of a rank
counts: an ``mp.spawn`` child replaces the parent that claimed its rank at
start-up). The daemon checks pids only of its own host; of another host's
processes it knows what that host's agent told the session (``RankExited``).

A local rank's process is watched through a pidfd in the daemon's poller, so
the daemon wakes the moment a rank dies: the first rank to go is the one the
session names as the cause, and a launcher tears the others down milliseconds
later.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from wire.procfs import alive, ended, torn_down

#: How long a rank that a teardown signal ended (SIGTERM, SIGINT, SIGHUP) is held back when no other rank was
#: found gone with it: its launcher's signal can end it before the kernel has finished the rank whose death
#: made the launcher send it, and that rank is the one to name first.
TEARDOWN_GRACE_S = 0.5


class RankProcesses:
    """Global rank -> registered pid and host, the ranks gone (and how), the ranks stopped in a debugger."""

    def __init__(self, host: str, watch: Callable[[int], None], unwatch: Callable[[int], None]):
        self.host = host  # this daemon's machine: ranks on another host are watched by their host's agent
        self._watch, self._unwatch = watch, unwatch  # add / remove a pidfd in the daemon's poller
        self.pidfds: dict[int, int] = {}  # local global rank -> pidfd of its registered process
        self.pids: dict[int, int] = {}  # global rank -> pid, from Hello
        self.hosts: dict[int, str] = {}  # global rank -> the host its pid is on, from Hello
        self.dead: dict[int, str] = {}  # global rank -> how it went
        # global rank -> pid of ranks that stopped in a debugger (--debug-rank) in this run: their waits are
        # not hangs while they are stopped, and their arrival times say nothing about stragglers
        self.debugged: dict[int, int] = {}
        self._gone_elsewhere: set[tuple[str, int]] = set()  # (host, pid) another host's agent saw exit
        self._held: dict[int, float] = {}  # local rank ended by a teardown signal -> when first found so

    def register(self, rank: int, pid: int, host: str) -> None:
        """``rank`` is process ``pid`` of ``host`` from now on."""
        self._forget_pidfd(rank)
        self._held.pop(rank, None)
        self.pids[rank] = pid
        self.hosts[rank] = host
        self.dead.pop(rank, None)  # a restarted rank (torchrun --max-restarts) is alive again
        if self.local(host):
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone (the next check finds it), or a kernel without pidfds: checks only
                return
            self.pidfds[rank] = fd
            self._watch(fd)

    def exited_elsewhere(self, rank: int, pid: int, host: str) -> bool:
        """Note that process ``pid`` of another ``host`` exited; whether it was ``rank``'s registered process."""
        self._gone_elsewhere.add((host, pid))
        return self.pids.get(rank) == pid and self.hosts.get(rank) == host

    def debugging(self, rank: int, pid: int) -> None:
        """``rank`` (process ``pid``) stopped in its debugger, or runs on from it, in this run."""
        self.debugged[rank] = pid

    def gone(self, rank: int, how: str) -> int:
        """``rank``'s process is gone (``how`` says how); returns its pid."""
        pid = self.pids.pop(rank)
        self.hosts.pop(rank, None)
        self._held.pop(rank, None)
        self._forget_pidfd(rank)
        self.dead[rank] = how
        return pid

    def local(self, host: str) -> bool:
        """Whether a process of ``host`` runs on this daemon's machine (its pid means something here)."""
        return not host or host == self.host

    def alive(self, pid: int, host: str = "") -> bool:
        """Whether process ``pid`` of ``host`` lives: seen here, or as its host's agent last said."""
        return alive(pid) if self.local(host) else (host, pid) not in self._gone_elsewhere

    def exited(self) -> list[tuple[int, int]]:
        """The registered (rank, pid) of this host whose process is gone, not yet marked :meth:`gone`.

        Several found at once: a rank its launcher terminated comes after one that died otherwise (killed,
        crashed, exited), which was likelier the cause; rank order among equals. Ranks all ended by a
        teardown signal wait up to :data:`TEARDOWN_GRACE_S` for such a rank to be found with them.
        """
        gone = ended((rank, pid) for rank, pid in self.pids.items() if self._local_rank(rank))
        if gone and all(torn_down(pid) for _, pid in gone):
            now = time.monotonic()
            for rank, _ in gone:
                if rank not in self._held:
                    self._held[rank] = now
                    self._forget_pidfd(rank)  # (a dead process's pidfd stays ready: the loop would spin on it)
            if now - min(self._held[rank] for rank, _ in gone) < TEARDOWN_GRACE_S:
                return []
        for rank, _ in gone:
            self._held.pop(rank, None)
        return gone

    def is_pidfd(self, fd: int) -> bool:
        """Whether ``fd`` (ready in the poller) is a watched rank's pidfd: that rank's process has ended."""
        return fd in self.pidfds.values()

    def close(self) -> None:
        """Stop watching every process."""
        for rank in list(self.pidfds):
            self._forget_pidfd(rank)

    def left_debugger(self) -> list[int]:
        """Ranks of this host that died in their debugger ('q'), forgotten as debugged from now on."""
        died = [rank for rank, pid in self.debugged.items() if self._local_rank(rank) and not alive(pid)]
        for rank in died:
            del self.debugged[rank]
        return died

    def local_pids(self) -> list[int]:
        """The registered pids of this host's ranks (another host's are its agent's to stop)."""
        return [pid for rank, pid in self.pids.items() if self._local_rank(rank)]

    def _forget_pidfd(self, rank: int) -> None:
        fd = self.pidfds.pop(rank, None)
        if fd is not None:
            self._unwatch(fd)
            os.close(fd)

    def _local_rank(self, rank: int) -> bool:
        return self.local(self.hosts.get(rank, ""))
