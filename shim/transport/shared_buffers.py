"""Zero-copy collectives for large tensors: the rank's storage itself becomes the daemon's buffer.

Staging a collective costs the rank a copy in (tensor -> arena) and a copy
out (arena -> tensor); at this machine's ~5 GB/s of memcpy a 64 MiB
all-reduce spent 27 ms of rank CPU on those, twice the daemon's 13 ms of
reducing. A storage that takes part in collectives again and again (DDP's
gradient buckets) is instead moved into shared memory *in place*
(``_share_fd_cpu_``: same storage, so every view of it follows) and its file
descriptor is handed to the daemon over the fast socket (SCM_RIGHTS, in a
``RegisterBuffer``); collectives then name the buffer and an offset, and the
daemon reduces straight into the tensor, as a GPU does in device memory.

Which storages: a collective tensor of at least ``MIRAGE_ZERO_COPY_MIN_BYTES`` whose storage
is counted by the wrapper at hand alone (``shim.memory.allocator`` follows the storage
to its new address), from its *second* collective on (``MIRAGE_ZERO_COPY``:
``reuse``, the default; ``always``; ``off``). A buffer allocated afresh for
each step (FSDP2's all-gather outputs) would otherwise pay the move (a copy
and fresh page faults, ~30 ms for 64 MiB) every time for one collective.

The daemon's mapping is let go when the storage dies: a finaliser queues the
id and the next collective tells the daemon (``ReleaseBuffers``, unanswered);
the daemon also drops all of a rank's buffers when its connection closes.

A storage in shared memory cannot be resized back after ``resize_(0)``
(torch crashes), which FSDP does to the storages it all-gathers into: so only
collectives whose output is their input (all-reduce, broadcast) take this
path, never an all-gather or reduce-scatter output.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from shim.memory import allocator  # noqa: F401 - it builds RUNTIME.allocator
from shim.rank.runtime import RUNTIME
from shim.transport import nccl_debug
from wire import schema as s

SHM_DIR = "/dev/shm"  # where torch puts a shared storage's (unlinked) file

#: Buffers a rank keeps registered at once; past this, tensors are staged.
MAX_BUFFERS = 1024


@dataclass
class _Buffer:
    buf: int  # the id the daemon knows it by
    ptr: int  # the storage's address when registered: a resized storage moved, and is dropped
    nbytes: int


class SharedBuffers:
    """One process's registered storages and its bookkeeping for the daemon (use under the collective lock)."""

    def __init__(self, client):
        self._client = client
        self._ids = itertools.count(1)
        # keyed by id(storage): torch keeps one Python object per storage for its whole life, and
        # the weak reference's callback drops the entry when it dies, before the id can be reused
        self._seen: dict[int, weakref.ref] = {}  # staged once (MODE "reuse")
        self._refused: dict[int, weakref.ref] = {}  # never again (could not be registered)
        self._live: dict[int, _Buffer] = {}
        self._released: deque[int] = deque()  # ids whose storage died, for the next ReleaseBuffers
        self.registered = 0  # storages registered so far (diagnostics and tests)
        self.zero_copy = 0  # collectives that ran on a registered buffer

    def live(self) -> int:
        return len(self._live)

    def flush(self) -> None:
        """Tell the daemon which buffers' storages died (no reply awaited)."""
        if self._released:
            bufs = []
            while self._released:
                bufs.append(self._released.popleft())
            self._client.send(s.ReleaseBuffers(bufs=bufs), reply=False)

    def locate(self, owner: torch.Tensor, elem: torch.Tensor) -> tuple[int, int] | None:
        """(buffer id, byte offset) of ``elem``'s data in a registered buffer, registering its storage
        if it qualifies now; None: stage it. ``owner`` is the collective's tensor (``elem`` its data)."""
        nbytes = elem.numel() * elem.element_size()
        # the smallest tensor (settings.zero_copy_min_bytes): zero-copy pays from far below (a 2-rank
        # all-reduce of 64 KiB: 141-153 us of rank CPU against 250-254 staged; 256 KiB: 172-199 against
        # 287-294), but each registered storage holds a descriptor, a mapping and its bytes in /dev/shm
        settings = RUNTIME.settings
        if settings.zero_copy == "off" or nbytes < settings.zero_copy_min_bytes or not self._client.has_fast:
            return None
        storage = elem.untyped_storage()
        key = id(storage)
        b = self._live.get(key)
        if b is not None:
            if storage.data_ptr() == b.ptr and storage.nbytes() == b.nbytes:
                self.zero_copy += 1
                return b.buf, elem.data_ptr() - b.ptr
            self._forget(key, b)  # resized under us (it moved out of shared memory): stage it from now on
            self._refuse(key, storage)
            return None
        if key in self._refused:
            return None
        if settings.zero_copy != "always" and key not in self._seen:
            self._seen[key] = weakref.ref(storage, lambda _, k=key: self._seen.pop(k, None))
            return None
        self._seen.pop(key, None)
        b = self._register(owner, storage)
        if b is None:
            self._refuse(key, storage)
            return None
        self._live[key] = b
        weakref.finalize(storage, self._died, key, b.buf)
        self.zero_copy += 1
        return b.buf, elem.data_ptr() - b.ptr

    def _register(self, owner: torch.Tensor, storage: torch.UntypedStorage) -> _Buffer | None:
        if len(self._live) >= MAX_BUFFERS:
            return None
        # /dev/shm must hold it (twice over, leaving room for the arenas): torch fills the new pages
        # with a plain copy, and a write past a full tmpfs is a SIGBUS, not an error
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < 2 * storage.nbytes():
            return None
        shared: list = []

        def move() -> int:
            # in place: the same storage, new memory (an unlinked shared-memory file); torch copies the
            # data over. Called on the base class: the shim's storage subclass reports a cuda device,
            # for which share_memory_() does nothing.
            shared.append(torch.UntypedStorage._share_fd_cpu_(storage))
            return storage.data_ptr()

        try:
            if not RUNTIME.allocator.rehome(owner, move):
                return None  # other wrappers count the storage at its old address
        except (RuntimeError, OSError):
            return None  # e.g. already shared by file name (torch.multiprocessing's file_system strategy)
        fd, _ = shared[0]  # torch's (the storage keeps it open); SCM_RIGHTS gives the daemon its own
        buf = next(self._ids)
        nbytes = storage.nbytes()
        reply = self._client.request(s.RegisterBuffer(buf=buf, nbytes=nbytes), fds=[fd])
        if isinstance(reply, s.Error):
            return None  # the daemon's limit, or no fast socket after all: the storage stays shared, staged
        self.registered += 1
        if nccl_debug.enabled():
            print(
                f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} [{owner.device.index}] NCCL INFO "
                f"mirage: registered buffer {buf} ({nbytes} bytes at {storage.data_ptr():#x}): its collectives "
                f"run zero-copy",
                file=sys.stdout, flush=True,
            )
        return _Buffer(buf, storage.data_ptr(), nbytes)

    def _refuse(self, key: int, storage) -> None:
        self._refused[key] = weakref.ref(storage, lambda _, k=key: self._refused.pop(k, None))

    def _forget(self, key: int, b: _Buffer) -> None:
        if self._live.get(key) is b:
            del self._live[key]
            self._released.append(b.buf)

    def _died(self, key: int, buf: int) -> None:
        # a finaliser: may run in any thread, inside anything (even with the collective lock held
        # by this thread), so it only takes note; flush() sends it
        b = self._live.get(key)
        if b is not None and b.buf == buf:
            del self._live[key]
            self._released.append(buf)


def of(client) -> SharedBuffers:
    """The process's registered buffers (one set per daemon connection)."""
    sb = getattr(client, "_shared_buffers", None)
    if sb is None:
        sb = client._shared_buffers = SharedBuffers(client)
    return sb
