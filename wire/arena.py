"""Shared-memory arenas: where collective inputs and outputs live.

Each rank owns one arena, a file in ``/dev/shm`` named after the session, that
it maps and copies tensors into; the daemon maps the same file and reduces in
place. Raw files rather than ``multiprocessing.shared_memory`` because its
resource tracker unlinks segments behind our back when a process exits.
"""

from __future__ import annotations

import mmap
import os
import re

import numpy as np

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^mirage-[0-9a-f]{6,32}-[A-Za-z0-9_.-]{1,64}$")


class ArenaError(ValueError):
    """An arena name that is malformed or not this session's."""


def arena_name(session: str, tag: str) -> str:
    """The shared-memory file name for ``tag`` (e.g. ``r3-g1``) of ``session``."""
    return f"mirage-{session}-{tag}"


def check_name(name: str, session: str) -> str:
    """Refuse names that could escape /dev/shm or belong to another session."""
    if not _NAME.match(name) or not name.startswith(f"mirage-{session}-"):
        raise ArenaError(f"arena {name!r} is not a shared-memory segment of session {session}")
    return name


def session_segments(session: str) -> list[str]:
    """Paths of every segment this session left in /dev/shm."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [os.path.join(SHM_DIR, n) for n in names if n.startswith(f"mirage-{session}-")]


class Arena:
    """A mapped shared-memory file; ``array`` views part of it as numpy."""

    def __init__(self, name: str, size: int, create: bool):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.buf = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)

    @classmethod
    def create(cls, name: str, size: int) -> Arena:
        return cls(name, size, create=True)

    @classmethod
    def open(cls, name: str) -> Arena:
        return cls(name, 0, create=False)

    def bytes_view(self, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 numpy view of ``nbytes`` at ``offset`` (bounds-checked)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ArenaError(
                f"range [{offset}, {offset + nbytes}) outside arena {self.name} of {self.size} bytes"
            )
        if nbytes == 0:
            return np.empty(0, np.uint8)
        return np.frombuffer(self.buf, np.uint8, nbytes, offset)

    def close(self) -> None:
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:
                # a numpy view is still alive; the mapping goes when it does
                pass
            self.buf = None

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
