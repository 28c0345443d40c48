"""The hang detector: collectives that some ranks joined and others never did, and worlds that never formed.

NCCL's watchdog notices such a collective after its timeout (10 minutes by
default) and only from the waiting side. The daemon sees every rank's posts,
so it can say after ``timeout_s`` which ranks are missing and what each one
last did, while the run is still alive to be inspected.

A rank stopped in a debugger (``--debug-rank``) is not missing, it is being
looked at; nor is a rank compiling (``torch.compile``: one rank's compile can
take longer than another's, or hit a cache the other misses). Nobody waiting for
such a rank is reported while it is paused so, and the timeout of a wait for it
counts from when it ran again.
"""

from __future__ import annotations

import time

from emulator.ledger import Communicator, Ledger, Worlds
from wire.schema import CollOp, HangDetected, HangKind


class HangDetector:
    """Reports each stuck (communicator, sequence number) once."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._reported: set[tuple[str, int | str]] = set()
        self._paused: dict[int, set[str]] = {}  # global rank -> why it is paused ("debugger", "compiling")
        self._resumed: dict[int, float] = {}  # global rank -> when it last ran again

    def pause(self, rank: int, reason: str, paused: bool, now: float | None = None) -> None:
        """Note that global rank ``rank`` paused for ``reason``, or runs again (or died so)."""
        reasons = self._paused.setdefault(rank, set())
        if paused:
            reasons.add(reason)
            return
        reasons.discard(reason)
        if not reasons:
            del self._paused[rank]
        self._resumed[rank] = time.monotonic() if now is None else now

    def debugger(self, rank: int, stopped: bool, now: float | None = None) -> None:
        """Note that global rank ``rank`` stopped in its debugger, or runs again (or died there)."""
        self.pause(rank, "debugger", stopped, now)

    def _since(self, began: float, missing) -> float | None:
        """When a wait for ``missing`` began to count: None while one of them is paused (in its debugger,
        compiling), else ``began`` or, if later, when the last of them ran again."""
        if any(r in self._paused for r in missing):
            return None
        return max([began, *(self._resumed.get(r, began) for r in missing)])

    def scan(self, ledger: Ledger, now: float | None = None, busy: frozenset[int] = frozenset()) -> list[HangDetected]:
        """Findings for every collective partially joined for longer than the timeout.

        ``busy`` holds global ranks inside a collective the daemon is still running
        (a large one, on another communicator): they are on their way, not stuck.
        """
        now = time.monotonic() if now is None else now
        found = []
        for comm in ledger.comms.values():
            if comm.failed:
                continue
            for (src, dst, n), halves in comm.p2p.items():
                (posted,) = halves.values()  # a complete pair is never left here
                key = (comm.comm, f"p2p {src}->{dst} #{n}")
                peer = _global(comm, dst if src == posted.request.rank else src)
                since = self._since(posted.at, (peer,))
                if key not in self._reported and since is not None and now - since >= self.timeout_s \
                        and peer not in busy:
                    self._reported.add(key)
                    found.append(_p2p_finding(comm, posted, peer, now - since))
            for seq, slot in comm.posted.items():
                if not slot or (comm.comm, seq) in self._reported:
                    continue
                missing = {_global(comm, r) for r in range(comm.size) if r not in slot}
                since = self._since(min(p.at for p in slot.values()), missing)
                if since is not None and now - since >= self.timeout_s and not missing & busy:
                    self._reported.add((comm.comm, seq))
                    found.append(_finding(comm, seq, now - since))
        return found


    def scan_worlds(self, worlds: Worlds, alive, now: float | None = None) -> list[HangDetected]:
        """Findings for every world some rank has waited to form for longer than the timeout.

        A world hangs while a live rank waits in ``init_process_group`` and ranks
        are missing from it (never arrived, or arrived and died); ``alive(pid, host)``
        tells live processes. Each world is reported once.
        """
        now = time.monotonic() if now is None else now
        found = []
        for world in worlds.worlds.values():
            if world.reported or all(a.formed for a in world.arrived.values()):
                continue  # (nobody waits: no need to ask which processes live)
            present = {r: a for r, a in world.arrived.items() if alive(a.pid, a.host)}
            waiting = [a.at for a in present.values() if not a.formed]
            if not waiting or len(present) == world.size:
                continue
            missing = [r for r in range(world.size) if r not in present]
            since = self._since(min(waiting), missing)
            if since is None or now - since < self.timeout_s:
                continue
            world.reported = True
            joined = sorted(present)
            found.append(HangDetected(
                comm=world.world, seq=0, op=CollOp.BARRIER, dtype="", numel=0, size=world.size,
                waited_s=round(now - since, 3), joined=joined, sites=[present[r].site for r in joined],
                missing=missing, last_enqueued=[0] * len(missing), last_completed=[0] * len(missing),
                kind=HangKind.WORLD,
            ))
        return found


def _global(comm: Communicator, rank: int) -> int:
    member = comm.members.get(rank)
    return member.global_rank if member is not None else rank


def _finding(comm: Communicator, seq: int, waited: float) -> HangDetected:
    slot = comm.posted[seq]
    req = next(iter(slot.values())).request
    joined = sorted(slot)
    missing = [r for r in range(comm.size) if r not in slot]
    return HangDetected(
        comm=comm.comm,
        seq=seq,
        op=req.op,
        dtype=req.dtype,
        numel=req.numel,
        size=comm.size,
        waited_s=round(waited, 3),
        joined=[_global(comm, r) for r in joined],
        sites=[slot[r].request.site for r in joined],
        missing=[_global(comm, r) for r in missing],
        last_enqueued=[comm.last_enqueued.get(r, 0) for r in missing],
        last_completed=[comm.last_completed.get(r, 0) for r in missing],
    )


def _p2p_finding(comm: Communicator, posted, peer: int, waited: float) -> HangDetected:
    """A send (or receive) whose peer never posted the other half."""
    req = posted.request
    return HangDetected(
        comm=comm.comm,
        seq=req.seq,
        op=req.op,
        dtype=req.dtype,
        numel=req.numel,
        size=comm.size,
        waited_s=round(waited, 3),
        joined=[_global(comm, req.rank)],
        sites=[req.site],
        missing=[peer],
        last_enqueued=[comm.last_enqueued.get(req.peer, 0)],
        last_completed=[comm.last_completed.get(req.peer, 0)],
    )
