"""Small collectives rank to rank: each rank's ring of slots in shared memory, read by its peers.

Through the daemon, a small all-reduce costs every rank a round trip on the
fast socket and the daemon a turn of its loop: on two cores, more CPU than
gloo's whole all-reduce. So an all-reduce or broadcast of at most
``RUNTIME.staging.direct_max_bytes`` (``MIRAGE_DIRECT_MAX_BYTES``, 64 KiB by default; 0 turns this
off), or a barrier, goes rank to rank instead, as RCCL's P2P transport reads
a peer's buffer directly:

- every rank of the communicator owns a ring, a ``/dev/shm`` file that only
  it writes: two counters (collectives *arrived* at, collectives *done*) and
  ``SLOTS`` slots, each a header (what the collective is) and its input;
- a rank posts by writing its input into its next slot, then bumping its
  arrival counter and waking whoever waits on it (a futex on the counter);
- it completes by waiting for every peer's arrival, checking that their
  headers match its own, and reducing the peers' slots itself, in rank order
  with the daemon's kernels, so every rank computes the bytes the daemon
  would; then it bumps its done counter, which lets peers reuse the slot.

The request still goes to the daemon, unanswered unless something is wrong:
its ledger matches, checks and publishes the collective as any other (so the
console, the hang detector, straggler warnings and the Flight Recorder see
it) and answers only with an error (a mismatch, a dead peer), which the
waiting rank picks up between futex waits.

The counters are plain stores into shared memory, read by peers without
locks: that relies on x86-64's store ordering (a peer that sees the counter
also sees the slot written before it), so elsewhere the daemon path stays.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import platform
import struct
import sys
import time
from collections.abc import Callable

import numpy as np

from shim.rank.runtime import RUNTIME
from wire import kernels
from wire.arena import SHM_DIR, arena_name
from wire.schema import DIRECT_OPS, CollOp, ReduceOp


def _max_bytes(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        print(f"mirage: MIRAGE_DIRECT_MAX_BYTES={raw!r} is not a byte count; use e.g. 65536, or 0 for off",
              file=sys.stderr)
        raise SystemExit(2) from None
    return max(0, min(value, 16 << 20))


def _size_rings(runtime) -> None:
    # the largest input taken rank to rank (bytes); 0 when the path is off (or not on x86-64)
    on = platform.machine() == "x86_64"
    runtime.staging.direct_max_bytes = _max_bytes(runtime.settings.direct_max_bytes) if on else 0


RUNTIME.attach(_size_rings)  # where this path loads: a bad value stops the ranks, not every process
#: Slots per ring: how many direct collectives a rank may post before its peers finished the oldest.
SLOTS = 8

_HEAD = 64  # the ring's counters: arrived (u32, the futex word) and done (u32)
_SLOT_HEAD = 64  # a slot's header (``_HEADER``), padded
_HEADER = struct.Struct("=6q")  # seq, op, dtype, numel, reduce op, root
_READY = struct.Struct("=d")  # after the header, not compared: clocked mode's emulated time the rank was ready
_OPS = {op: i for i, op in enumerate(CollOp)}
_REDUCE = {op: i for i, op in enumerate(ReduceOp)}
_DTYPES = {name: i for i, name in enumerate(kernels.DTYPES)}

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
#: How long one futex wait lasts before the waiter checks for the daemon's errors and its deadline.
WAIT_SLICE_S = 0.05
#: How many times a waiter yields its core before it sleeps on the futex: a peer on another
#: core is usually microseconds away, and a futex round trip costs more than that.
SPINS = 40


class RingError(OSError):
    """A ring that cannot be made (``/dev/shm`` is full)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` holds ``expected`` (at most ``timeout_s``; a signal wakes it too)."""
    ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _reached(counter: int, n: int) -> bool:
    """Whether u32 ``counter`` has reached ``n`` (mod 2**32: a long run wraps it)."""
    return (counter - n) & 0xFFFFFFFF < 0x80000000


def eligible(op: CollOp, nbytes: int, dtype: str, reduce_op: ReduceOp) -> bool:
    """Whether a collective goes rank to rank; the same answer on every rank that runs the same collective."""
    max_bytes = RUNTIME.staging.direct_max_bytes
    if not max_bytes or op not in DIRECT_OPS or nbytes > max_bytes or dtype not in _DTYPES:
        return False
    if op is CollOp.ALLREDUCE:
        try:
            kernels.check_reduce(reduce_op, dtype)
        except kernels.KernelError:
            return False  # the daemon says why
    return True


class _Ring:
    """One rank's ring file, mapped: its counters and its slots."""

    def __init__(self, path: str, fd: int, slot_bytes: int):
        self.path = path
        self.slot_bytes = slot_bytes
        self.map = mmap.mmap(fd, _HEAD + SLOTS * (_SLOT_HEAD + slot_bytes))
        self.counters = np.frombuffer(self.map, np.uint32, 2, 0)  # [arrived, done]
        self.arrived_at = self.counters.__array_interface__["data"][0]

    def _at(self, slot: int) -> int:
        return _HEAD + slot * (_SLOT_HEAD + self.slot_bytes)

    def head(self, slot: int) -> bytes:
        """A slot's header, packed (``_HEADER``)."""
        at = self._at(slot)
        return self.map[at : at + _HEADER.size]

    def data(self, slot: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of a slot's input, as bytes."""
        return np.frombuffer(self.map, np.uint8, nbytes, self._at(slot) + _SLOT_HEAD)

    @property
    def arrived(self) -> int:
        return int(self.counters[0])

    @property
    def done(self) -> int:
        return int(self.counters[1])


class PeerRings:
    """A communicator's rings as one rank sees them: its own, written, and its peers', read."""

    def __init__(self, session: str, comm: str, rank: int, size: int):
        self.rank, self.size = rank, size
        self._names = [arena_name(session, f"d{comm}-r{r}") for r in range(size)]
        self.posted = 0  # direct collectives this rank posted on the communicator
        self.heads: dict[int, bytes] = {}  # by ring index: the header this rank posted there
        self._rings: list[_Ring | None] = [None] * size
        self._rings[rank] = self._create()
        RUNTIME.staging.rings.append((os.getpid(), self._rings[rank].path, self))

    def _create(self) -> _Ring:
        # written under a temporary name and renamed: a peer never maps a file not yet its full size
        path = os.path.join(SHM_DIR, self._names[self.rank])
        tmp = f"{path}.{os.getpid()}"
        max_bytes = RUNTIME.staging.direct_max_bytes
        size = _HEAD + SLOTS * (_SLOT_HEAD + max_bytes)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # every page now: a write into a full /dev/shm later would be a SIGBUS
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise RingError(
                    f"mirage: no room in {SHM_DIR} for a rank-to-rank ring of {size} bytes ({e.strerror}); "
                    "free some, or set MIRAGE_DIRECT_MAX_BYTES=0 (every collective through the daemon)"
                ) from None
            ring = _Ring(path, fd, max_bytes)
            os.rename(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return ring

    def _ring(self, r: int) -> _Ring | None:
        """Peer ``r``'s ring, mapped on first use; None while the peer has not made it yet."""
        ring = self._rings[r]
        if ring is None:
            path = os.path.join(SHM_DIR, self._names[r])
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                return None
            try:
                size = os.fstat(fd).st_size
                ring = self._rings[r] = _Ring(path, fd, (size - _HEAD) // SLOTS - _SLOT_HEAD)
            finally:
                os.close(fd)
        return ring

    def slot_free(self, index: int) -> bool:
        """Whether every rank has finished the collective that last used ``index``'s slot."""
        oldest = index - SLOTS
        if oldest < 1:
            return True
        for r in range(self.size):
            ring = self._ring(r)
            if ring is None or not _reached(ring.done, oldest):
                return False
        return True

    def post(self, seq: int, op: CollOp, dtype: str, numel: int, reduce_op: ReduceOp, root: int,
             data: memoryview | None, t_ready: float = 0.0) -> int:
        """Write the next slot (``data``: its input's bytes, if it sends any; ``t_ready``: in clocked mode,
        when this rank's stream let the collective start) and announce it; returns its ring index. The
        caller has made sure the slot is free (:meth:`slot_free`)."""
        index = self.posted + 1
        mine = self._rings[self.rank]
        at = mine._at((index - 1) % SLOTS)
        head = _HEADER.pack(seq, _OPS[op], _DTYPES[dtype], numel, _REDUCE[reduce_op], root)
        mine.map[at : at + _HEADER.size] = head
        mine.map[at + _HEADER.size : at + _HEADER.size + _READY.size] = _READY.pack(t_ready)
        if data is not None:
            mine.map[at + _SLOT_HEAD : at + _SLOT_HEAD + data.nbytes] = data
        self.posted = index
        self.heads[index] = head
        mine.counters[0] = index & 0xFFFFFFFF  # after the slot: peers that see it see the slot
        _futex_wake(mine.arrived_at)
        return index

    def arrived(self, index: int) -> bool:
        """Whether every peer has posted its ``index``-th direct collective (never blocks)."""
        for r in range(self.size):
            ring = self._ring(r)
            if ring is None or not _reached(ring.arrived, index):
                return False
        return True

    def wait(self, index: int, deadline: float, check: Callable[[], None]) -> bool:
        """Wait until every peer has posted ``index``; False at ``deadline``.

        ``check`` runs between futex waits (every ``WAIT_SLICE_S``): it raises
        to give up (the daemon answered with an error, or is gone)."""
        for r in range(self.size):
            spins = 0
            while True:
                ring = self._ring(r)
                if ring is not None:
                    value = ring.arrived
                    if _reached(value, index):
                        break
                if spins < SPINS:
                    spins += 1
                    os.sched_yield()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if ring is None:  # the peer has not posted anything here yet: no word to wait on
                    time.sleep(min(left, 0.001))
                else:
                    _futex_wait(ring.arrived_at, value, min(left, WAIT_SLICE_S))
                check()
        return True

    def matches(self, index: int) -> bool:
        """Whether every peer posted the same collective as this rank at ``index`` (once :meth:`arrived`)."""
        slot = (index - 1) % SLOTS
        mine = self.heads[index]
        return all(self._rings[r].head(slot) == mine for r in range(self.size))

    def start_time(self, index: int) -> float:
        """Clocked mode: when the collective at ``index`` starts in emulated time, its last member's
        ``t_ready`` (once :meth:`arrived`), as the daemon would say."""
        slot = (index - 1) % SLOTS
        return max(_READY.unpack_from(ring.map, ring._at(slot) + _HEADER.size)[0] for ring in self._rings)

    def inputs(self, index: int, nbytes: int) -> list[np.ndarray]:
        """Every rank's input at ``index``, in rank order, as bytes."""
        slot = (index - 1) % SLOTS
        return [self._rings[r].data(slot, nbytes) for r in range(self.size)]

    def peers_done(self) -> bool:
        """Whether every peer has finished every collective this rank posted (read its inputs from this ring)."""
        if not self.posted:
            return True
        for r in range(self.size):
            ring = self._ring(r)
            if ring is None or not _reached(ring.done, self.posted):
                return False
        return True

    def finish(self, index: int) -> None:
        """Mark ``index`` done by this rank: its slot may be written again once every rank has."""
        self.heads.pop(index, None)
        self._rings[self.rank].counters[1] = index & 0xFFFFFFFF


@atexit.register
def _unlink_owned() -> None:
    # the ring files made here (RUNTIME.staging.rings); the session removes them if the rank is killed
    for pid, path, rings in RUNTIME.staging.rings:
        if pid != os.getpid():
            continue  # a forked child's exit: its parent still uses them
        if not rings.peers_done():
            # a peer has yet to read this rank's last inputs (it maps a ring when it first looks at
            # it, maybe after this process is gone): the file stays, and the session removes it
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
