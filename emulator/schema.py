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
import re
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


#: Collectives small enough may go rank to rank (``Collective.direct``): their output is every
#: rank's input, reduced, or the root's.
DIRECT_OPS = (CollOp.ALLREDUCE, CollOp.BROADCAST, CollOp.BARRIER)


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


class WorldPhase(str, Enum):
    """Where a rank is in forming its world (``init_process_group``)."""

    JOINING = "joining"  # about to wait in init_process_group (the store rendezvous) for its peers
    FORMED = "formed"  # init_process_group returned: every rank of the world arrived
    FAILED = "failed"  # init_process_group raised (its timeout, a bad argument)


@dataclass(frozen=True)
class WorldFormation(Request):
    """Rank ``rank`` of a world of ``size`` ranks enters or leaves ``init_process_group``.

    ``world`` names the rendezvous (its address and the how-many-th world of it
    this process forms), so that the ranks of one world agree on it; ``site`` is
    where the user's code called ``init_process_group``.
    """

    TYPE: ClassVar[str] = "world_formation"
    world: str = ""
    rank: int = 0
    size: int = 1
    pid: int = 0
    site: str = ""
    phase: WorldPhase = WorldPhase.JOINING


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
    # SHM only: a buffer the rank registered (RegisterBuffer), nonzero, holds the input/output
    # itself at byte offset in_off/out_off instead of the arena (zero-copy: the rank's tensor)
    in_buf: int = 0
    out_buf: int = 0
    # rank to rank (the shim's direct path): the ranks exchange the data through their own shared
    # rings; the daemon matches, checks and publishes it, and answers only with an error
    direct: bool = False


@dataclass(frozen=True)
class RegisterBuffer(Request):
    """The rank lends the daemon a tensor's storage as buffer ``buf`` (a positive id of its choosing).

    Fast socket only: the storage's shared-memory file descriptor travels with
    this message (SCM_RIGHTS; never a name another process could open). The
    daemon maps ``nbytes`` of it until ``ReleaseBuffers`` names it or the
    connection closes; collectives then refer to it by ``in_buf``/``out_buf``.
    """

    TYPE: ClassVar[str] = "register_buffer"
    buf: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class ReleaseBuffers(Request):
    """The rank's storages behind buffers ``bufs`` are gone: the daemon unmaps them (the rank does not
    wait for the reply)."""

    TYPE: ClassVar[str] = "release_buffers"
    bufs: list[int] = field(default_factory=list)


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


class HangKind(str, Enum):
    """What a hang waits for."""

    COLLECTIVE = "collective"  # a collective (or message) some ranks posted and others did not
    WORLD = "world"  # init_process_group: ranks that never arrived to form the world


@dataclass(frozen=True)
class WorldStage(Event):
    """A rank's ``WorldFormation``, as the daemon recorded it."""

    TYPE: ClassVar[str] = "world"
    world: str = ""
    rank: int = 0
    size: int = 1
    site: str = ""
    phase: WorldPhase = WorldPhase.JOINING


@dataclass(frozen=True)
class HangDetected(Event):
    """Collective ``seq`` of ``comm``: some ranks joined ``waited_s`` ago, others never came.

    Ranks are global ranks; ``sites`` pairs with ``joined`` (where each joined
    rank called the collective), ``last_enqueued``/``last_completed`` pair with
    ``missing`` (the last sequence numbers those ranks posted and finished).
    With ``kind`` WORLD, ``comm`` is the world (``WorldFormation.world``), ``op``
    BARRIER and ``seq`` 0: ``joined`` ranks wait in ``init_process_group`` (at
    ``sites``), ``missing`` ranks never reached it.
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
    kind: HangKind = HangKind.COLLECTIVE

    def waiting_for(self) -> str:
        """What the waiting ranks wait in, in words: ``collective #7 (allreduce) of 3f2a…``."""
        if self.kind is HangKind.WORLD:
            return f"world formation (init_process_group) of {self.comm[:8]}"
        return f"collective #{self.seq} ({self.op.value}) of {self.comm[:8]}"


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


#: ``_ENCODER``'s C encoder, made once: ``JSONEncoder.encode`` makes a new one on every call, a
#: third of encoding a small message (a small all-reduce encodes six: two replies, four events).
#: No circular-reference check (``markers`` None): messages are flat dataclasses of JSON values.
try:
    _C_ENCODE = json.encoder.c_make_encoder(
        None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
except (AttributeError, TypeError):  # no C accelerator (or another signature): the encoder's own path
    _C_ENCODE = None


def _json_value(value) -> str:
    """``value`` as JSON text, as the encoder writes it."""
    return _ENCODER.encode(value) if _C_ENCODE is None else "".join(_C_ENCODE(value, 0))


def _generic(body: dict) -> bytes:
    return _json_value(body).encode()


#: message class -> its generated encoder (see :func:`_make_encoder`), or None: the generic path
_ENCODERS: dict[type, typing.Callable[[dict], bytes] | None] = {}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _make_encoder(cls: type) -> typing.Callable[[dict], bytes] | None:
    """An encoder for ``cls`` generated from its fields: one f-string from the message's ``__dict__``.

    Byte for byte what the generic path writes (the C encoder over the whole
    dict: every field in declared order), at half its cost: a small all-reduce
    makes six messages in the daemon (four events, two replies). A value that
    is not of its field's type (a bool or a non-finite float, a missing or
    extra field) takes the generic path, which writes it as it always has.
    """
    if not dataclasses.is_dataclass(cls) or not _NAME.match(cls.TYPE or ""):
        return None
    hints = typing.get_type_hints(cls)
    loads, checks, parts = [], [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        if not _NAME.match(f.name):
            return None
        hint, v = hints[f.name], f"v{i}"
        loads.append(f"{v} = d[{f.name!r}]")
        if hint is str or (isinstance(hint, type) and issubclass(hint, str)):  # str enums write their value
            parts.append(f'"{f.name}":{{_ESCAPE({v})}}')  # (TypeError for a non-str: generic path)
        elif hint is int:
            checks.append(f"type({v}) is int")
            parts.append(f'"{f.name}":{{{v}}}')
        elif hint is float:
            checks.append(f"type({v}) is float and {v} - {v} == 0.0")  # NaN, inf: written as json writes them
            parts.append(f'"{f.name}":{{{v}!r}}')
        else:
            parts.append(f'"{f.name}":{{_json_value({v})}}')
    text = ",".join([f'{{{{"v":{VERSION},"type":"{cls.TYPE}"'] + parts) + "}}"
    src = (
        "def encode_fast(d):\n"
        f"    if len(d) != {len(loads)}:\n"
        "        return _generic({'v': _VERSION, 'type': _TYPE, **d})\n"
        + "".join(f"    {line}\n" for line in loads)
        + f"    if {' and '.join(checks) or 'True'}:\n"
        "        try:\n"
        f"            return f'{text}'.encode()\n"
        "        except TypeError:\n"
        "            pass\n"
        "    return _generic({'v': _VERSION, 'type': _TYPE, **d})\n"
    )
    namespace = {"_ESCAPE": json.encoder.encode_basestring_ascii, "_json_value": _json_value, "_generic": _generic,
                 "_VERSION": VERSION, "_TYPE": cls.TYPE}
    exec(src, namespace)
    return namespace["encode_fast"]


def encode(msg: Message, **fields) -> bytes:
    """Serialise ``msg`` to its JSON wire form, with ``fields`` in place of its own (unchecked: the
    caller's, e.g. a request's token and id, spares a copy of the message)."""
    # every enum here is a str enum, which json writes as its value; fields keep their declared order
    cls = type(msg)
    fast = _ENCODERS[cls] if cls in _ENCODERS else _ENCODERS.setdefault(cls, _make_encoder(cls))
    body = msg.__dict__
    if fields:
        if fast is None or not fields.keys() <= body.keys():
            return _generic({"v": VERSION, "type": msg.TYPE, **body, **fields})
        body = {**body, **fields}
    if fast is None:
        return _generic({"v": VERSION, "type": msg.TYPE, **body})
    return fast(body)


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
        members = {m.value: m for m in hint}  # a dict lookup: calling the enum class costs ~1 us

        def check_enum(value):
            if type(value) is str and value in members:
                return members[value]
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


#: Per message class, how :func:`decode` builds it without calling its ``__init__`` (a frozen
#: dataclass's sets each field through ``object.__setattr__``: 6 us for a Collective), one entry
#: per field in declared order: (name, the exact type a valid value has, or None, its checker,
#: its default, its default factory or None). None for a class that needs its ``__init__``.
_PLANS: dict[type, list[tuple] | None] = {}
_EXACT = (int, str, bool, float)


def _plan(cls: type) -> list[tuple] | None:
    if cls in _PLANS:
        return _PLANS[cls]
    hints = typing.get_type_hints(cls)
    plan: list[tuple] | None = []
    for f, (name, check) in zip(dataclasses.fields(cls), _fields(cls)):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            plan = None  # a required field: __init__ says so when it is missing
            break
        exact = hints[name] if hints[name] in _EXACT else None  # (float: an int is also valid, via check)
        factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
        plan.append((name, exact, check, f.default, factory))
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        plan = None
    _PLANS[cls] = plan
    return plan


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf or nan (1e999 parses as inf)
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
#: The decoder's C scanner: what ``_DECODER.decode`` runs after two Python calls and two regex
#: matches for whitespace, which a message as encoded here does not have.
_SCAN = _DECODER.scan_once


def _make_decoder(cls: type, plan: list[tuple]) -> typing.Callable[[dict], Message | None]:
    """A builder for ``cls`` generated from its plan, for the common case: a body with every field
    and nothing else (as :func:`encode` writes it), each value of its exact type. None for any
    other body, which takes the field-by-field path (defaults, errors, ``int`` as ``float``)."""
    hints = typing.get_type_hints(cls)
    namespace: dict = {"_new": object.__new__, "_cls": cls}
    loads, checks, later, items = [], [], [], []
    for i, (name, exact, check, _default, _factory) in enumerate(plan):
        hint, v = hints[name], f"v{i}"
        loads.append(f"{v} = body[{name!r}]")
        if exact is not None:
            checks.append(f"type({v}) is {exact.__name__}")
        elif isinstance(hint, type) and issubclass(hint, Enum):
            namespace[f"_members{i}"] = {m.value: m for m in hint}
            later.append(f"{v} = _members{i}.get({v}) if type({v}) is str else None")
            later.append(f"if {v} is None:\n        return None")
        else:
            namespace[f"_check{i}"] = check  # lists: checked as the general path checks them
            later.append(f"{v} = _check{i}({v})")
        items.append(f"{name!r}: {v}")
    src = (
        "def decode_fast(body):\n"
        f"    if len(body) != {len(plan) + 2}:\n"
        "        return None\n"
        "    try:\n"
        + "".join(f"        {line}\n" for line in loads)
        + "    except KeyError:\n"
        "        return None\n"
        f"    if not ({' and '.join(checks) or 'True'}):\n"
        "        return None\n"
        + "".join(f"    {line}\n" for line in later)
        + "    msg = _new(_cls)\n"
        f"    msg.__dict__.update({{{', '.join(items)}}})\n"
        "    return msg\n"
    )
    exec(src, namespace)
    return namespace["decode_fast"]


_DECODERS: dict[type, typing.Callable[[dict], Message | None] | None] = {}


def decode(data: bytes | str) -> Message:
    """Parse one wire message; raise :class:`SchemaError` on anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        text = data.decode() if isinstance(data, bytes) else data
        try:
            body, end = _SCAN(text, 0)
            if end != len(text):
                raise ValueError("more than one JSON value")
        except (ValueError, StopIteration):  # whitespace around it, or not JSON: the full parse says which
            body = _DECODER.decode(text)
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
    plan = _PLANS[cls] if cls in _PLANS else _plan(cls)
    if plan is None:
        return cls(**{name: check(body[name]) for name, check in _fields(cls) if name in body})
    fast = _DECODERS[cls] if cls in _DECODERS else _DECODERS.setdefault(cls, _make_decoder(cls, plan))
    msg = fast(body)
    if msg is not None:
        return msg
    # what the dataclass's __init__ would store, in field order (encode relies on it), each value checked
    values = {}
    for name, exact, check, default, factory in plan:
        if name in body:
            value = body[name]
            values[name] = value if type(value) is exact else check(value)
        else:
            values[name] = default if factory is None else factory()
    msg = object.__new__(cls)
    msg.__dict__.update(values)
    return msg


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


def _fast_init(cls: type):
    """``cls.__init__`` filling ``__dict__`` in one go (same parameters, defaults and factories).

    A frozen dataclass's own sets each field through ``object.__setattr__``: 2
    to 6 us per message, and the daemon makes six per small all-reduce. None
    where the dataclass's own is needed (``__post_init__``, ``init=False`` or
    keyword-only fields).
    """
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or any(not f.init or f.kw_only or not _NAME.match(f.name) for f in fields):
        return None
    namespace: dict = {"_MISSING": dataclasses.MISSING}
    params, items = [], []
    for i, f in enumerate(fields):
        if f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory{i}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            items.append(f"{f.name!r}: _factory{i}() if {f.name} is _MISSING else {f.name}")
        elif f.default is not dataclasses.MISSING:
            namespace[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
            items.append(f"{f.name!r}: {f.name}")
        else:
            params.append(f.name)
            items.append(f"{f.name!r}: {f.name}")
    exec(f"def __init__(self, {', '.join(params)}):\n    self.__dict__.update({{{', '.join(items)}}})\n", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


for _cls in list(_REGISTRY.values()):
    _init = _fast_init(_cls)
    if _init is not None:
        _cls.__init__ = _init
