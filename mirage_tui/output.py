"""Turn rank and node output into lines: tail the rank files, read the node pipes.

Ranks write their stdout/stderr straight into ``ranks/rank-<r>.<stream>``
(see ``shim/rank/output.py``); :class:`RankTail` follows those files and hands out
complete lines. Node processes (torchrun's agent, or a direct rank before its
shim took over) write to pipes that :func:`pump_pipe` reads.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import IO

from wire.schema import OutputLine, Stream

_RANK_FILE = re.compile(r"^rank-(\d+)\.(stdout|stderr)$")
#: A line longer than this is emitted in pieces of at most this size (each piece one event, which
#: every reader of events.jsonl can take), rather than held forever.
MAX_LINE = 1 << 16
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _decode(raw: bytes) -> str:
    return _ANSI.sub("", raw.decode("utf-8", errors="replace").rstrip("\r"))


def _pieces(raw: bytes) -> list[bytes]:
    """``raw`` cut into pieces of at most ``MAX_LINE`` bytes, never inside a UTF-8 character."""
    out = []
    while len(raw) > MAX_LINE:
        cut = MAX_LINE
        while cut > MAX_LINE - 4 and raw[cut] & 0xC0 == 0x80:  # a continuation byte: back off to its start
            cut -= 1
        out.append(raw[:cut])
        raw = raw[cut:]
    out.append(raw)
    return out


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
            if len(rest) > MAX_LINE and not final:  # a long line without its end yet: emit its whole pieces
                *whole, rest = _pieces(rest)
                complete += whole
            for raw in complete:
                for piece in _pieces(raw):
                    lines.append(OutputLine(rank=rank, stream=stream, text=_decode(piece)))
            if rest and final:
                lines.extend(OutputLine(rank=rank, stream=stream, text=_decode(p)) for p in _pieces(rest))
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
