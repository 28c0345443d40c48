"""The wire format shared by the daemon, the shim and the console.

Every message is one JSON object with a version ``v`` and a ``type``. Requests
(rank -> daemon) and replies (daemon -> rank) travel over the daemon's ROUTER
socket; events (daemon/session -> anyone) over its PUB socket and into
``events.jsonl``. Each message kind is a frozen dataclass here, so no stringly
dict crosses a module boundary: ``decode`` turns bytes into one of these types
or raises :class:`SchemaError`, which the daemon answers with an error reply.

JSON only, never pickle: a peer can send us nothing but data.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
import typing
from dataclasses import dataclass, field
from collections.abc import Iterator
from enum import Enum
from typing import ClassVar

VERSION = 1
#: Largest request the daemon will parse; tensors never travel inline in the JSON.
MAX_MESSAGE_BYTES = 1 << 20
#: Largest data frame a rank sends (the socket transport): a tensor's bytes go in frames of this
#: size after the request's JSON frame, every frame but the last full; the daemon's transport
#: drops connections that send bigger frames.
MAX_DATA_FRAME_BYTES = 16 * MAX_MESSAGE_BYTES
#: The daemon's second request socket (next to its ZeroMQ ``rpc.sock``): a unix SOCK_SEQPACKET
#: socket, one message per request or reply, for requests without data frames. ZeroMQ moves
#: each message through an I/O thread at either end (about 56 us a round trip here, against
#: 5 us for a bare unix socket), which dominated a small collective's latency.
FAST_SOCKET = "fast.sock"
#: Largest message on the fast socket, either way; anything bigger goes through ZeroMQ.
FAST_MAX_MESSAGE_BYTES = 64 << 10
#: Sent to a rank process to make it append its Python stacks to ``ranks/rank-<r>.stacks``.
STACK_SIGNAL = signal.SIGUSR1


class SchemaError(ValueError):
    """A message that is not valid JSON or does not match its declared type."""


class ReduceOp(str, Enum):
    """Reduction operators, with torch's ``ReduceOp`` names in lower case."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


class CollOp(str, Enum):
    """Collective kinds the daemon executes (NCCL's OpType names, lower case)."""

    ALLREDUCE = "allreduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALLGATHER = "allgather"
    GATHER = "gather"
    SCATTER = "scatter"
    REDUCE_SCATTER = "reduce_scatter"
    ALLTOALL = "alltoall"
    BARRIER = "barrier"
    SEND = "send"  # point-to-point: seq counts this (src, dst) pair's messages, not the collectives
    RECV = "recv"


class Transport(str, Enum):
    """How one rank's collective data reaches the daemon and comes back."""

    SHM = "shm"  # the rank's shared-memory arena (RCCL's P2P/SHM transports)
    SOCKET = "socket"  # ZeroMQ frames after the request and after its Done (RCCL's NET/Socket)


class Stream(str, Enum):
    STDOUT = "stdout"
    STDERR = "stderr"


_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """Base of every message; subclasses set ``TYPE``."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("TYPE"):
            _REGISTRY[cls.TYPE] = cls


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Request(Message):
    token: str = ""
    req: int = 0  # per-client request id, echoed in the reply


@dataclass(frozen=True)
class Ping(Request):
    """Liveness check; the daemon answers Ok and republishes DaemonReady."""

    TYPE: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Hello(Request):
    """A rank process announces itself (pid, node, global rank if known)."""

    TYPE: ClassVar[str] = "hello"
    rank: int = -1
    node: int = 0
    pid: int = 0


@dataclass(frozen=True)
class CommInit(Request):
    """A rank joins communicator ``comm`` (a uuid agreed through the c10d store)."""

    TYPE: ClassVar[str] = "comm_init"
    comm: str = ""
    rank: int = 0  # rank within the communicator
    size: int = 1
    global_rank: int = 0
    node: int = 0
    host: str = ""  # NCCL_HOSTID: ranks on one host must not share a GPU
    transport: str = "shm"


@dataclass(frozen=True)
class MemoryReport(Request):
    """A rank's allocator figures for one GPU, sent when they change (a few times a second at most)."""

    TYPE: ClassVar[str] = "memory_report"
    rank: int = 0
    node: int = 0
    device: int = 0  # the node's GPU, not the rank's visible ordinal
    allocated: int = 0  # bytes, as torch.cuda.memory_allocated
    reserved: int = 0  # bytes, as torch.cuda.memory_reserved
    peak: int = 0  # bytes, as torch.cuda.max_memory_allocated
    total: int = 0  # the GPU's capacity (the profile's HBM or --hbm)


@dataclass(frozen=True)
class Collective(Request):
    """Rank ``rank`` of ``comm`` posts collective number ``seq``.

    With ``transport`` SHM its input and output live in the rank's
    shared-memory arena ``arena`` at byte offsets ``in_off``/``out_off``; with
    SOCKET the input bytes follow as data frames (see ``MAX_DATA_FRAME_BYTES``)
    and the output comes back as a data frame after ``Done``. ``numel``
    counts input elements.
    """

    TYPE: ClassVar[str] = "collective"
    comm: str = ""
    seq: int = 0
    rank: int = 0
    op: CollOp = CollOp.ALLREDUCE
    reduce_op: ReduceOp = ReduceOp.SUM
    dtype: str = "float32"
    numel: int = 0
    out_numel: int = 0
    root: int = 0
    device: int = 0
    arena: str = ""
    in_off: int = 0
    out_off: int = 0
    site: str = ""  # file:line:function of the call in the user's code
    splits: list[int] = field(default_factory=list)  # ALLTOALL: elements this rank sends to each rank
    peer: int = -1  # SEND/RECV: the other rank, within the communicator
    transport: Transport = Transport.SHM


# ---------------------------------------------------------------- replies


@dataclass(frozen=True)
class Reply(Message):
    req: int = 0


@dataclass(frozen=True)
class Ok(Reply):
    TYPE: ClassVar[str] = "ok"


@dataclass(frozen=True)
class Error(Reply):
    """The request failed; ``code`` is an NCCL result name where one fits."""

    TYPE: ClassVar[str] = "error"
    code: str = "ncclInternalError"
    message: str = ""


@dataclass(frozen=True)
class Done(Reply):
    """Collective ``seq`` of ``comm`` finished; the output is in the arena (SOCKET: in the data frame that follows)."""

    TYPE: ClassVar[str] = "done"
    comm: str = ""
    seq: int = 0
    # on a communicator's first collective (NCCL connects its rings then): each rank's GPU and host
    devices: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Event(Message):
    t: float = field(default_factory=time.time)


@dataclass(frozen=True)
class DaemonReady(Event):
    TYPE: ClassVar[str] = "daemon_ready"
    pid: int = 0
    profile: str = ""
    nodes: int = 1
    gpus_per_node: int = 1


@dataclass(frozen=True)
class RankRegistered(Event):
    TYPE: ClassVar[str] = "rank_registered"
    rank: int = 0
    node: int = 0
    pid: int = 0


@dataclass(frozen=True)
class RankGone(Event):
    """The daemon noticed a registered rank's process is gone (exit code unknown to it)."""

    TYPE: ClassVar[str] = "rank_gone"
    rank: int = 0
    pid: int = 0


@dataclass(frozen=True)
class MemoryUsage(Event):
    """GPU memory a rank holds on one device (from its MemoryReport)."""

    TYPE: ClassVar[str] = "memory_usage"
    rank: int = 0
    node: int = 0
    device: int = 0
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    total: int = 0


@dataclass(frozen=True)
class CommJoined(Event):
    TYPE: ClassVar[str] = "comm_joined"
    comm: str = ""
    rank: int = 0
    size: int = 1
    global_rank: int = 0
    transport: str = "shm"


@dataclass(frozen=True)
class CollectiveEnqueued(Event):
    TYPE: ClassVar[str] = "coll_enqueued"
    comm: str = ""
    seq: int = 0
    rank: int = 0
    op: CollOp = CollOp.ALLREDUCE
    dtype: str = "float32"
    numel: int = 0
    device: int = 0
    site: str = ""
    transport: Transport = Transport.SHM  # how this rank's data travels


@dataclass(frozen=True)
class CollectiveStarted(Event):
    TYPE: ClassVar[str] = "coll_started"
    comm: str = ""
    seq: int = 0
    op: CollOp = CollOp.ALLREDUCE
    total_bytes: int = 0


@dataclass(frozen=True)
class CollectiveProgress(Event):
    TYPE: ClassVar[str] = "coll_progress"
    comm: str = ""
    seq: int = 0
    done_bytes: int = 0
    total_bytes: int = 0


@dataclass(frozen=True)
class CollectiveCompleted(Event):
    TYPE: ClassVar[str] = "coll_completed"
    comm: str = ""
    seq: int = 0
    op: CollOp = CollOp.ALLREDUCE
    total_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CommFailed(Event):
    TYPE: ClassVar[str] = "comm_failed"
    comm: str = ""
    code: str = ""
    message: str = ""


@dataclass(frozen=True)
class HangDetected(Event):
    """Collective ``seq`` of ``comm``: some ranks joined ``waited_s`` ago, others never came.

    Ranks are global ranks; ``sites`` pairs with ``joined`` (where each joined
    rank called the collective), ``last_enqueued``/``last_completed`` pair with
    ``missing`` (the last sequence numbers those ranks posted and finished).
    """

    TYPE: ClassVar[str] = "hang"
    comm: str = ""
    seq: int = 0
    op: CollOp = CollOp.ALLREDUCE
    dtype: str = "float32"
    numel: int = 0
    size: int = 0
    waited_s: float = 0.0
    joined: list[int] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    last_enqueued: list[int] = field(default_factory=list)
    last_completed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StragglerWarning(Event):
    """Global rank ``rank`` arrived last, ``mean_margin_s`` behind the others, ``count`` times in a row."""

    TYPE: ClassVar[str] = "straggler"
    comm: str = ""
    rank: int = 0
    count: int = 0
    mean_margin_s: float = 0.0


@dataclass(frozen=True)
class HangReport(Event):
    """The session's diagnosis of a hang (rendered text; JSON in ``path``)."""

    TYPE: ClassVar[str] = "hang_report"
    comm: str = ""
    seq: int = 0
    text: str = ""
    path: str = ""


@dataclass(frozen=True)
class ProtocolError(Event):
    """The daemon refused a message (bad token, malformed, out of order)."""

    TYPE: ClassVar[str] = "protocol_error"
    message: str = ""


@dataclass(frozen=True)
class OutputLine(Event):
    """One line a rank (``rank`` >= 0) or node process (``node``) printed."""

    TYPE: ClassVar[str] = "output"
    rank: int = -1
    node: int = -1
    stream: Stream = Stream.STDOUT
    text: str = ""


@dataclass(frozen=True)
class ProcessExited(Event):
    """A node process (launched by the session) ended."""

    TYPE: ClassVar[str] = "process_exited"
    node: int = 0
    pid: int = 0
    returncode: int = 0


@dataclass(frozen=True)
class SessionEnded(Event):
    TYPE: ClassVar[str] = "session_ended"
    returncode: int = 0
    summary: str = ""


# ---------------------------------------------------------------- codec


#: Built once: ``json.dumps``/``json.loads`` with options build a new encoder/decoder per call,
#: which was a fifth of the daemon's time per collective (it encodes and decodes several messages each).
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode(msg: Message, **fields) -> bytes:
    """Serialise ``msg`` to its JSON wire form, with ``fields`` in place of its own (unchecked: the
    caller's, e.g. a request's token and id, spares a copy of the message)."""
    # every enum here is a str enum, which json writes as its value; fields keep their declared order
    return _ENCODER.encode({"v": VERSION, "type": msg.TYPE, **msg.__dict__, **fields}).encode()


def _checker(name: str, hint: object):
    """A function that validates (and normalises) one field's JSON value; built once per field."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        each = _checker(f"{name}[]", item)

        def check_list(value):
            if not isinstance(value, list):
                raise SchemaError(f"field {name!r}: expected a list, got {type(value).__name__}")
            return [each(v) for v in value]

        return check_list
    if isinstance(hint, type) and issubclass(hint, Enum):
        def check_enum(value):
            try:
                return hint(value)
            except ValueError:
                choices = ", ".join(m.value for m in hint)
                raise SchemaError(f"field {name!r}: {value!r} is not one of {choices}") from None

        return check_enum
    if hint is float:
        def check_float(value):
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise SchemaError(f"field {name!r}: expected float, got {type(value).__name__}")

        return check_float

    def check_exact(value):
        # exact types: JSON gives int, str, bool, float; a bool is not an int here
        if type(value) is not hint:
            raise SchemaError(f"field {name!r}: expected {hint.__name__}, got {type(value).__name__}")
        return value

    return check_exact


_FIELDS: dict[type, list[tuple[str, object]]] = {}


def _fields(cls: type) -> list[tuple[str, object]]:
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _FIELDS[cls] = [(f.name, _checker(f.name, hints[f.name])) for f in dataclasses.fields(cls)]
    return fields


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf or nan (1e999 parses as inf)
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def decode(data: bytes | str) -> Message:
    """Parse one wire message; raise :class:`SchemaError` on anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = _DECODER.decode(data.decode() if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SchemaError(f"not JSON: {e}") from None
    if not isinstance(body, dict):
        raise SchemaError("message must be a JSON object")
    if type(body.get("v")) is not int or body["v"] != VERSION:
        raise SchemaError(f"unsupported version {body.get('v')!r}, expected {VERSION}")
    kind = body.get("type")
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SchemaError(f"unknown message type {body.get('type')!r}")
    return cls(**{name: check(body[name]) for name, check in _fields(cls) if name in body})


def encode_events(events: list[bytes]) -> bytes:
    """One PUB frame for several encoded events: newline-separated, as in ``events.jsonl``."""
    return b"\n".join(events)


def iter_events(lines) -> Iterator[tuple[Event, bytes]]:
    """Each event among encoded ``lines`` with its line; malformed lines are skipped (a live writer
    may have cut the last one short)."""
    for line in lines:
        try:
            msg = decode(line)
        except SchemaError:
            continue
        if isinstance(msg, Event):
            yield msg, line


def decode_events(frame: bytes) -> list[Event]:
    """The events of one PUB frame (see :func:`encode_events`)."""
    return [event for event, _ in iter_events(frame.split(b"\n"))]
