"""Fault injection (``mirage run --inject``): the spec shared by the CLI and the shim.

``rank=1,seq=7,action=hang|delay:2s|crash|skip`` makes global rank 1 misbehave at
collective #7 of its default process group (the first one it creates):

- ``hang``: never post it (sleep forever), as a rank stuck in its own code;
- ``delay:2s``: post it 2 seconds late;
- ``crash``: abort the process (SIGABRT) instead of posting;
- ``skip``: return without posting, as a rank whose code skipped the call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

#: Environment variable that carries the specs to the ranks (joined by ';').
ENV = "MIRAGE_INJECT"
_DELAY = re.compile(r"^delay:(\d+(?:\.\d+)?)(ms|s)?$")


class FaultError(ValueError):
    """A malformed ``--inject`` spec; the message says what a valid one looks like."""


class Action(str, Enum):
    HANG = "hang"
    DELAY = "delay"
    CRASH = "crash"
    SKIP = "skip"


@dataclass(frozen=True)
class Fault:
    rank: int
    seq: int
    action: Action
    delay_s: float = 0.0

    def spec(self) -> str:
        # milliseconds, plain decimal: what parse() reads back, whatever the value
        action = f"delay:{round(self.delay_s * 1000, 3)}ms" if self.action is Action.DELAY else self.action.value
        return f"rank={self.rank},seq={self.seq},action={action}"


_USAGE = "expected rank=R,seq=N,action=hang|delay:2s|crash|skip"


def parse(spec: str) -> Fault:
    """Parse one ``--inject`` value; raise :class:`FaultError` naming what is wrong."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("rank", "seq", "action") or key in fields:
            raise FaultError(f"--inject {spec!r}: {_USAGE}")
        fields[key] = value.strip()
    if set(fields) != {"rank", "seq", "action"}:
        raise FaultError(f"--inject {spec!r}: {_USAGE}")
    try:
        rank, seq = int(fields["rank"]), int(fields["seq"])
    except ValueError:
        raise FaultError(f"--inject {spec!r}: rank and seq must be whole numbers; {_USAGE}") from None
    if rank < 0 or seq < 1:
        raise FaultError(f"--inject {spec!r}: rank counts from 0 and seq from 1")
    action = fields["action"]
    m = _DELAY.match(action)
    if m:
        delay = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
        return Fault(rank, seq, Action.DELAY, delay)
    try:
        return Fault(rank, seq, Action(action))
    except ValueError:
        raise FaultError(f"--inject {spec!r}: unknown action {action!r}; {_USAGE}") from None


def parse_env(value: str) -> list[Fault]:
    """The faults a rank was given through :data:`ENV`."""
    return [parse(spec) for spec in value.split(";") if spec]
