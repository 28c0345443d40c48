"""Turn rank and node output into lines: tail the rank files, read the node pipes.

Ranks write their stdout/stderr straight into ``ranks/rank-<r>.<stream>``
(see ``shim/output.py``); :class:`RankTail` follows those files and hands out
complete lines. Node processes (torchrun's agent, or a direct rank before its
shim took over) write to pipes that :func:`pump_pipe` reads.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import IO

from emulator.schema import OutputLine, Stream

_RANK_FILE = re.compile(r"^rank-(\d+)\.(stdout|stderr)$")
#: A line longer than this is emitted in pieces rather than held forever.
MAX_LINE = 1 << 16
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _decode(raw: bytes) -> str:
    return _ANSI.sub("", raw.decode("utf-8", errors="replace").rstrip("\r"))


class RankTail:
    """Follows every rank file in a folder; :meth:`poll` returns new lines."""

    def __init__(self, folder: str):
        self.folder = folder
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}

    def poll(self, final: bool = False) -> list[OutputLine]:
        """New complete lines since the last call (and partial ones if ``final``)."""
        lines: list[OutputLine] = []
        try:
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            return lines
        for name in names:
            m = _RANK_FILE.match(name)
            if not m:
                continue
            rank, stream = int(m.group(1)), Stream(m.group(2))
            path = os.path.join(self.folder, name)
            offset = self._offsets.get(name, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(16 << 20)
            except OSError:
                continue
            self._offsets[name] = offset + len(data)
            buf = self._partial.pop(name, b"") + data
            *complete, rest = buf.split(b"\n")
            for raw in complete:
                lines.append(OutputLine(rank=rank, stream=stream, text=_decode(raw)))
            if rest and (final or len(rest) > MAX_LINE):
                lines.append(OutputLine(rank=rank, stream=stream, text=_decode(rest)))
            elif rest:
                self._partial[name] = rest
        return lines


def pump_pipe(pipe: IO[bytes], node: int, stream: Stream, emit: Callable[[OutputLine], None]) -> threading.Thread:
    """Read a node process's pipe on a thread, emitting one event per line."""

    def run() -> None:
        with pipe:
            for raw in iter(lambda: pipe.readline(MAX_LINE), b""):
                emit(OutputLine(node=node, stream=stream, text=_decode(raw.rstrip(b"\n"))))

    t = threading.Thread(target=run, name=f"node{node}-{stream.value}", daemon=True)
    t.start()
    return t
