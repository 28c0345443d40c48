"""What host daemons say to each other in a multi-host run: the data of collectives across hosts.

A communicator whose members run on several hosts is served by every one of
those hosts' daemons, each for its own ranks (``CommInit.hosts``); the daemons
exchange the data among themselves, as RCCL's nodes do over the network, and
the head's daemon keeps only the books (``Transport.HOSTS``). Each daemon binds
one ROUTER on the run's interface and connects a DEALER to each other host's;
every message is sealed with the run's peer keys (``emulator.peer_seal``) and
carries the session token, checked on arrival, and a :class:`PeerChunk` is
followed by its bytes, sealed too.

The messages are the wire format's, in a catalogue of their own
(:data:`PEER_TYPES`), so that a peer link takes nothing but these and a rank's
socket never one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from wire import schema as s

#: every peer message class by its ``type``
PEER_TYPES: dict[str, type[PeerMessage]] = {}
#: The largest data a peer sends after one header: a chunk of a collective (``emulator.host_exchange.CHUNK_BYTES``,
#: at most this); a link drops the connection of a peer that sends more, before buffering it.
MAX_PEER_FRAME_BYTES = 4 << 20


class PeerPhase(str, Enum):
    """What a chunk of a collective across hosts is (``emulator.host_exchange``)."""

    PARTIAL = "partial"  # the sender's ranks reduced: for the host that owns the piece, to reduce with the others
    RESULT = "result"  # a finished piece (reduced, or a rank's input to copy): its owner sends it to every other host


@dataclass(frozen=True)
class PeerMessage(s.Message):
    """Base of the peer messages: registered in :data:`PEER_TYPES`; ``host`` is the sender's."""

    CATALOGUE: ClassVar[dict[str, type[s.Message]]] = PEER_TYPES
    token: str = ""
    host: str = ""


@dataclass(frozen=True)
class PeerChunk(PeerMessage):
    """Elements ``at`` .. ``at + count`` of collective ``seq`` of ``comm`` (``numel`` elements of ``dtype``
    in all), in its ``phase``; its bytes follow as one frame. ``op``, ``reduce_op``, ``dtype`` and ``numel``
    let the receiver check that both hosts run the same collective."""

    TYPE: ClassVar[str] = "chunk"
    comm: str = ""
    seq: int = 0
    phase: PeerPhase = PeerPhase.PARTIAL
    op: s.CollOp = s.CollOp.ALLREDUCE
    reduce_op: s.ReduceOp = s.ReduceOp.SUM
    dtype: str = "float32"
    numel: int = 0
    at: int = 0
    count: int = 0


@dataclass(frozen=True)
class PeerBeat(PeerMessage):
    """The sender's daemon is alive (sent every ``BEAT_S`` on every link): a host silent for longer than
    ``emulator.peer_links.SILENCE_S`` fails the collectives waiting on it."""

    TYPE: ClassVar[str] = "beat"


def decode(data: bytes) -> PeerMessage:
    """The peer message in ``data``; raise :class:`wire.messages.SchemaError` if it is not a well-formed one."""
    return s.decode(data, PEER_TYPES)
