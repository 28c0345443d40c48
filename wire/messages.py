"""The message catalogue: every request, reply and event of the wire format, and its limits.

Requests (rank -> daemon) and replies (daemon -> rank) travel over the
daemon's ROUTER socket and its fast socket; events (daemon/session -> anyone)
over its PUB socket and into ``events.jsonl``. Each message kind is a frozen
dataclass here, so no stringly dict crosses a module boundary. How they become
bytes and back is :mod:`wire.codec`; import both through
:mod:`wire.schema`.

Up to 700 lines on purpose: this is the one catalogue of the wire format, a list
of small dataclasses with no logic between them, read by looking a message up;
split by topic, a reader would search several files for one exchange.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

__all__ = [
    "MESSAGE_TYPES",
    "VERSION", "MAX_MESSAGE_BYTES", "MAX_DATA_FRAME_BYTES", "FAST_MAX_MESSAGE_BYTES",
    "STACK_SIGNAL", "SchemaError", "ReduceOp", "CollOp", "Transport", "DIRECT_OPS", "Stream", "Message",
    "Request", "Ping", "Hello", "CommInit", "WorldPhase", "WorldFormation", "MemoryReport", "Collective",
    "StepReport", "ClockedStep",
    "RegisterBuffer", "ReleaseBuffers", "PeerDirectory", "Reply", "Ok", "Error", "Done", "Event", "DaemonReady",
    "RankRegistered", "RankGone", "MemoryUsage", "CommJoined", "CollectiveEnqueued", "CollectiveStarted",
    "CollectiveProgress", "CollectiveCompleted", "CommFailed", "HangKind", "WorldStage", "HangDetected",
    "StragglerWarning", "HangReport", "ProtocolError", "OutputLine", "ProcessExited", "SessionEnded",
    "DebugPhase", "DebuggerState", "RankDebugging", "RankExited", "HostLost", "CompileState", "RankCompiling",
]

VERSION = 1
#: Largest request the daemon will parse; tensors never travel inline in the JSON.
MAX_MESSAGE_BYTES = 1 << 20
#: Largest data frame a rank sends (the socket transport): a tensor's bytes go in frames of this
#: size after the request's JSON frame, every frame but the last full; the daemon's transport
#: drops connections that send bigger frames.
MAX_DATA_FRAME_BYTES = 16 * MAX_MESSAGE_BYTES
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
    SHAPES = "shapes"  # estimate mode: no data at all; matched, booked and timed by its shape alone
    # a communicator across hosts (multi-host runs): the data goes host daemon to host daemon
    # (``wire.peers``); the head's daemon matches, checks and publishes it, and answers only with an error
    HOSTS = "hosts"


#: Collectives small enough may go rank to rank (``Collective.direct``): their output is every
#: rank's input, reduced, or the root's.
DIRECT_OPS = (CollOp.ALLREDUCE, CollOp.BROADCAST, CollOp.BARRIER)


class Stream(str, Enum):
    STDOUT = "stdout"
    STDERR = "stderr"


#: every message class by its ``type`` (each subclass with a TYPE registers itself)
MESSAGE_TYPES: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """Base of every message; subclasses set ``TYPE``, and register in their base's ``CATALOGUE``.

    The daemon's messages are :data:`MESSAGE_TYPES`; another protocol on the same codec (the
    multi-host agents', ``mirage_tui.hosts.protocol``) gives its base class a catalogue of its own,
    so that neither side decodes the other's messages.
    """

    TYPE: ClassVar[str] = ""
    CATALOGUE: ClassVar[dict[str, type[Message]]] = MESSAGE_TYPES

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("TYPE"):
            cls.CATALOGUE[cls.TYPE] = cls


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
    host: str = ""  # the machine it runs on (its hostname): the daemon checks only its own host's pids
    launched_pid: int = 0  # the process its launcher started, if a fork server forked this one (its stub)


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
    # torch's names for the group, so that readers can show it as torch does: ``group_name`` ("0", "1", or a
    # hash of the ranks) and ``group_desc`` ("default_pg", "mesh_tp", a new_group's group_desc, "undefined")
    name: str = ""
    desc: str = ""
    # a host daemon's share of a communicator across hosts: the hosts of its members (hostnames, in the
    # order of each one's first rank); ``rank`` and ``size`` then count the members on this host only
    hosts: list[str] = field(default_factory=list)
    # and the host of every rank of the communicator (an index into ``hosts``), so that each host daemon knows
    # which ranks' pieces of an all-gather, a reduce-scatter or a broadcast come from or go to which host
    host_of: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PeerDirectory(Request):
    """A host's agent tells its daemon where the other hosts' daemons take peer links: host -> [endpoint,
    cipher], and the run key their links are sealed with, in hex (multi-host runs; both came from the head over
    the agents' CURVE bus)."""

    TYPE: ClassVar[str] = "peer_directory"
    peers: dict[str, list[str]] = field(default_factory=dict)
    key: str = ""


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
    host: str = ""  # the machine ``pid`` runs on (its hostname), as in Hello


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
    # clocked mode: the emulated time (seconds) at which this rank's stream lets the collective
    # start; the daemon starts it when the last member is ready (0 in functional mode)
    t_ready: float = 0.0


@dataclass(frozen=True)
class StepReport(Request):
    """Clocked mode: one optimizer step of one rank in emulated time (unanswered when it arrives)."""

    TYPE: ClassVar[str] = "step_report"
    rank: int = 0
    node: int = 0
    step: int = 0  # 1 for the first optimizer step of the process
    t_start: float = 0.0  # emulated seconds: the end of the previous step (or of the first op)
    t_end: float = 0.0  # emulated seconds: when the GPU finished this step's work
    compute_s: float = 0.0  # time kernels ran on any stream
    comm_s: float = 0.0  # time collectives ran on the communication streams
    exposed_comm_s: float = 0.0  # communication time no kernel overlapped
    ops: int = 0  # kernels modeled in the step
    bytes_only_ops: int = 0  # of which torch has no FLOP formula for (costed by their bytes)


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
    # clocked mode: when the collective ran in emulated time (seconds) and how RCCL would run it
    t_start: float = 0.0
    t_end: float = 0.0
    algo: str = ""  # "ring/Simple", "tree/LL", ...


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
    exec_mode: str = "functional"  # or "clocked": the run keeps emulated time
    # a host daemon's peer links (multi-host runs): where other hosts' daemons connect, and the cipher it seals with
    peer_endpoint: str = ""
    peer_cipher: str = ""


@dataclass(frozen=True)
class RankRegistered(Event):
    TYPE: ClassVar[str] = "rank_registered"
    rank: int = 0
    node: int = 0
    pid: int = 0
    host: str = ""
    launched_pid: int = 0  # the fork server's stub the launcher watches; 0: pid is what it started


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
class ClockedStep(Event):
    """A rank's StepReport, as the daemon received it (clocked mode)."""

    TYPE: ClassVar[str] = "clocked_step"
    rank: int = 0
    node: int = 0
    step: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    ops: int = 0
    bytes_only_ops: int = 0


@dataclass(frozen=True)
class CommJoined(Event):
    TYPE: ClassVar[str] = "comm_joined"
    comm: str = ""
    rank: int = 0
    size: int = 1
    global_rank: int = 0
    transport: str = "shm"
    name: str = ""  # torch's group_name and group_desc, as the rank's CommInit gave them ("": not known)
    desc: str = ""


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
    # clocked mode: when it ran in emulated time (seconds from the run's start) and the algorithm
    emulated_start: float = 0.0
    emulated_end: float = 0.0
    algo: str = ""


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

    def waiting_for(self, label: str = "") -> str:
        """What the waiting ranks wait in, in words: ``collective #7 (allreduce) of default_pg``.

        ``label`` names the communicator (a reader's, from its ``comm_joined`` events); without one, the
        first characters of its id.
        """
        if self.kind is HangKind.WORLD:
            return f"world formation (init_process_group) of {self.comm[:8]}"
        return f"collective #{self.seq} ({self.op.value}) of {label or self.comm[:8]}"


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


# ---------------------------------------------------------------- a rank in a debugger (--debug-rank)


class DebugPhase(str, Enum):
    """Where a rank run with ``--debug-rank`` is with its debugger."""

    WAITING = "waiting"  # stopped, listening for a debugger client to connect
    PAUSED = "paused"  # stopped at the debugger's prompt, a client attached
    RUNNING = "running"  # running again (continued, stepping to the next line, or the client left)


@dataclass(frozen=True)
class CompileState(Request):
    """Rank ``rank`` (process ``pid``) began (``compiling``) or ended a ``torch.compile`` compilation: while it
    compiles, nobody waits on it as if it hung (one rank's compile can outlast another's)."""

    TYPE: ClassVar[str] = "compile_state"
    rank: int = 0
    pid: int = 0
    compiling: bool = False


@dataclass(frozen=True)
class DebuggerState(Request):
    """Rank ``rank`` (process ``pid``) entered or left its debugger; while stopped, nobody should wait on it
    as if it hung. ``address`` is where the debugger listens (``127.0.0.1:PORT``), ``connect`` the command
    that attaches to it."""

    TYPE: ClassVar[str] = "debugger_state"
    rank: int = 0
    node: int = 0
    pid: int = 0
    phase: DebugPhase = DebugPhase.WAITING
    debugger: str = "pdb"  # or "debugpy"
    address: str = ""
    connect: str = ""


@dataclass(frozen=True)
class RankCompiling(Event):
    """Rank ``rank`` began (``compiling``) or ended a ``torch.compile`` compilation (its ``CompileState``)."""

    TYPE: ClassVar[str] = "rank_compiling"
    rank: int = 0
    pid: int = 0
    compiling: bool = False


@dataclass(frozen=True)
class RankDebugging(Event):
    """A rank's ``DebuggerState``, as the daemon recorded it."""

    TYPE: ClassVar[str] = "rank_debugging"
    rank: int = 0
    node: int = 0
    pid: int = 0
    phase: DebugPhase = DebugPhase.WAITING
    debugger: str = "pdb"
    address: str = ""
    connect: str = ""


# ---------------------------------------------------------------- ranks on other hosts (--launcher slurm)


@dataclass(frozen=True)
class RankExited(Request):
    """Process ``pid`` of rank ``rank``, on host ``host``, is gone: the daemon cannot see another host's
    processes, so that host's agent (``mirage_tui.hosts.agent``) tells it, through the session."""

    TYPE: ClassVar[str] = "rank_exited"
    rank: int = 0
    pid: int = 0
    host: str = ""


@dataclass(frozen=True)
class HostLost(Event):
    """A host of a multi-host run stopped answering (its agent, its slurmd, or the machine went away);
    ``nodes`` and ``ranks`` are the emulated nodes and the ranks it ran."""

    TYPE: ClassVar[str] = "host_lost"
    host: str = ""
    nodes: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    why: str = ""
