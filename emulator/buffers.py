"""Rank buffers: tensors ranks lent the daemon, mapped, so collectives run on them without staging.

A rank whose large tensor takes part in collectives again and again (DDP's
gradient buckets) moves its storage into shared memory and passes the file
descriptor over the fast socket (``RegisterBuffer`` with SCM_RIGHTS, see
``shim/transport/shared_buffers.py``). The daemon maps it here, keyed by (connection,
buffer id), and closes the descriptor at once: nothing is named in /dev/shm,
nothing another process could open. A collective that names the buffer
(``Collective.in_buf``/``out_buf``) is then reduced straight in the rank's
tensor, as a GPU reduces in device memory, sparing the rank a copy in and a
copy out (each about 13 ms for 64 MiB on this machine's memory bandwidth).

A mapping never outlives its client: ``drop`` lets go of all of a connection's
buffers when it closes. A job still running on one keeps the memory alive
through its numpy views until it ends (``mmap.close`` refuses while views
exist; the mapping then goes with the last view).

Like the arenas, a buffer is only as sound as its owner: a rank that truncates
the file under the daemon would fault the daemon's access (SIGBUS) — the
shim never does (torch's shared storages are never resized in place).
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np

from wire.arena import ArenaError

#: What one client may have mapped at once (the rank side registers far less: its persistent
#: collective buffers). Beyond it a registration is refused and the rank stages that tensor.
MAX_BYTES_PER_CLIENT = 256 << 30
MAX_BUFFERS_PER_CLIENT = 4096


class BufferError_(ArenaError):
    """A registration or a reference to a registered buffer that cannot be honoured."""


def _close(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # a running job's numpy views still use it; the mapping goes with them


class RankBuffers:
    """Every client's registered buffers: (client, buffer id) -> its mapping."""

    def __init__(self, max_bytes: int = MAX_BYTES_PER_CLIENT, max_count: int = MAX_BUFFERS_PER_CLIENT):
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._maps: dict[bytes, dict[int, mmap.mmap]] = {}
        self._bytes: dict[bytes, int] = {}

    def count(self, client: bytes | None = None) -> int:
        """Buffers mapped now (of ``client``, or of everyone)."""
        if client is not None:
            return len(self._maps.get(client, ()))
        return sum(len(m) for m in self._maps.values())

    def mapped_bytes(self, client: bytes) -> int:
        return self._bytes.get(client, 0)

    def register(self, client: bytes, buf: int, nbytes: int, fds: list[int]) -> None:
        """Map ``nbytes`` of the one descriptor in ``fds`` as ``client``'s buffer ``buf``.

        The descriptors are the caller's to close (it closes whatever came with the message).
        Raises :class:`BufferError_` (the client gets an error reply) for anything off.
        """
        if len(fds) != 1:
            raise BufferError_(f"register_buffer needs exactly one file descriptor (sent over the fast socket), "
                               f"got {len(fds)}")
        if buf <= 0:
            raise BufferError_(f"buffer id {buf} must be positive")
        mine = self._maps.get(client, {})
        if buf in mine:
            raise BufferError_(f"buffer {buf} is already registered")
        if nbytes <= 0:
            raise BufferError_(f"buffer {buf}: size {nbytes} must be positive")
        if len(mine) >= self.max_count:
            raise BufferError_(f"buffer {buf}: this rank already has {len(mine)} buffers registered")
        if self._bytes.get(client, 0) + nbytes > self.max_bytes:
            raise BufferError_(f"buffer {buf}: {nbytes} bytes more would pass the {self.max_bytes} bytes a rank "
                               f"may have registered")
        st = os.fstat(fds[0])
        if not stat.S_ISREG(st.st_mode):
            raise BufferError_(f"buffer {buf}: the descriptor is not a shared-memory file")
        if st.st_size < nbytes:
            raise BufferError_(f"buffer {buf}: {nbytes} bytes declared, its file holds {st.st_size}")
        try:
            m = mmap.mmap(fds[0], nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:  # e.g. a read-only descriptor
            raise BufferError_(f"buffer {buf}: cannot map it: {e}") from None
        self._maps.setdefault(client, {})[buf] = m
        self._bytes[client] = self._bytes.get(client, 0) + nbytes

    def release(self, client: bytes, bufs: list[int]) -> None:
        """Let go of ``client``'s buffers ``bufs`` (unknown ids are ignored: a release is idempotent)."""
        mine = self._maps.get(client)
        if not mine:
            return
        for buf in bufs:
            m = mine.pop(buf, None)
            if m is not None:
                self._bytes[client] -= len(m)
                _close(m)
        if not mine:
            self.drop(client)

    def drop(self, client: bytes) -> None:
        """``client`` is gone (its connection closed): every mapping of its goes."""
        for m in self._maps.pop(client, {}).values():
            _close(m)
        self._bytes.pop(client, None)

    def view(self, client: bytes, buf: int, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 view of ``nbytes`` at ``offset`` of ``client``'s buffer ``buf`` (bounds-checked)."""
        m = self._maps.get(client, {}).get(buf)
        if m is None:
            raise BufferError_(f"buffer {buf} is not registered by this rank")
        if offset < 0 or nbytes < 0 or offset + nbytes > len(m):
            raise BufferError_(f"range [{offset}, {offset + nbytes}) outside buffer {buf} of {len(m)} bytes")
        if nbytes == 0:
            return np.empty(0, np.uint8)
        return np.frombuffer(m, np.uint8, nbytes, offset)

    def close(self) -> None:
        for client in list(self._maps):
            self.drop(client)
