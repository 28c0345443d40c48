"""What the session and a host's agent say to each other in a multi-host run (``--launcher slurm``).

The head's session binds one ZeroMQ ROUTER on TCP (CURVE: the agents know its
public key, so no other process can pose as the head and have them start
programs); each host's agent (:mod:`mirage_tui.hosts.agent`) connects a DEALER.
The agent's first message, :class:`AgentHello`, carries the session token; the
session ignores a connection until it has presented it. The messages are the
wire format's (:class:`wire.messages.Message` subclasses, encoded and checked by
:mod:`wire.codec` as the daemon's are) in a catalogue of their own,
:data:`AGENT_TYPES`, so that neither the daemon nor an agent takes the other's;
output lines travel in the daemon's own event encoding, so the session records
them as it does its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from wire import schema as s

#: every agent message class by its ``type``
AGENT_TYPES: dict[str, type[AgentMessage]] = {}
#: The largest message either side takes (a part of a trace file, a batch of output lines): the head's
#: ZeroMQ socket drops bigger ones (``zmq.MAXMSGSIZE``, set from this in ``mirage_tui.hosts.head``).
MAX_AGENT_MESSAGE_BYTES = 64 << 20
#: The head sends a Heartbeat this often, and each agent too.
HEARTBEAT_S = 0.5
#: A peer silent this long is gone: the agent stops its programs, the session ends the run naming the host.
SILENCE_S = 5.0
#: The variable every process started for a host carries (its host's name): the agent's sweep at the end finds
#: them by it, and ``mirage exec`` knows from a node's environment which host to run a probe on.
HOST_TAG = "MIRAGE_AGENT_HOST"
#: Beside it in a remote node's environment file: the host's index in the allocation (``srun --relative``).
SLURM_INDEX = "MIRAGE_SLURM_NODE"


@dataclass(frozen=True)
class AgentMessage(s.Message):
    """Base of the agents' messages: registered in :data:`AGENT_TYPES`, not the daemon's catalogue."""

    CATALOGUE: ClassVar[dict[str, type[s.Message]]] = AGENT_TYPES


# ---------------------------------------------------------------- agent -> session


@dataclass(frozen=True)
class AgentHello(AgentMessage):
    """An agent is up on ``host`` (Slurm's node ``slurm_node``); ``address`` is its interface's address,
    ``master_port`` a free port there (torchrun's rendezvous when it hosts node 0); ``peer_endpoint`` and
    ``peer_cipher`` are where its daemon takes the other hosts' daemons' links, and the cipher it seals them with."""

    TYPE: ClassVar[str] = "hello"
    token: str = ""
    host: str = ""
    address: str = ""
    slurm_node: int = 0
    pid: int = 0
    master_port: int = 0
    peer_endpoint: str = ""
    peer_cipher: str = ""


@dataclass(frozen=True)
class Output(AgentMessage):
    """Output lines of the host's ranks and node processes, each an encoded ``OutputLine`` event."""

    TYPE: ClassVar[str] = "output"
    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DaemonEvents(AgentMessage):
    """Events of the host's own daemon (its communicators inside the host), each encoded as in ``events.jsonl``."""

    TYPE: ClassVar[str] = "daemon_events"
    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Exited(AgentMessage):
    """Process ``index`` of the host's :class:`Launch` (pid ``pid``) ended with ``returncode``."""

    TYPE: ClassVar[str] = "exited"
    index: int = 0
    pid: int = 0
    returncode: int = 0


@dataclass(frozen=True)
class RankGone(AgentMessage):
    """A rank process the session asked the agent to :class:`Watch` is gone."""

    TYPE: ClassVar[str] = "rank_gone"
    rank: int = 0
    pid: int = 0


@dataclass(frozen=True)
class Stacks(AgentMessage):
    """The answer to :class:`DumpStacks` ``req``: per rank, ``[process status, stacks]``."""

    TYPE: ClassVar[str] = "stacks"
    req: int = 0
    ranks: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceFile(AgentMessage):
    """Part ``part`` (from 0) of a clocked rank's trace ``traces/<name>`` on the agent's host; ``last`` ends it.

    Sent before :class:`Finished`, in order, so that the head merges every host's ranks."""

    TYPE: ClassVar[str] = "trace"
    name: str = ""
    part: int = 0
    data: str = ""
    last: bool = False


@dataclass(frozen=True)
class Finished(AgentMessage):
    """Every process the agent started has ended and its output was sent."""

    TYPE: ClassVar[str] = "finished"


# ---------------------------------------------------------------- session -> agent


@dataclass(frozen=True)
class Process:
    """One process to start: node ``node``'s command, or (``--nproc-per-node``) its rank ``rank``."""

    node: int
    rank: int | None
    env: dict[str, str]


@dataclass(frozen=True)
class Peers(AgentMessage):
    """Where every host's daemon takes peer links: host -> [endpoint, cipher], and the run key (hex) their links
    are sealed with (``emulator.peer_seal``), drawn by the head for this run. Sent once every agent said hello,
    before any :class:`Launch`, so that a communicator across hosts finds its daemons linked."""

    TYPE: ClassVar[str] = "peers"
    hosts: dict[str, list[str]] = field(default_factory=dict)
    key: str = ""


@dataclass(frozen=True)
class Launch(AgentMessage):
    """Start ``processes`` (each runs ``command`` in ``workdir``)."""

    TYPE: ClassVar[str] = "launch"
    command: list[str] = field(default_factory=list)
    workdir: str = ""
    processes: list[Process] = field(default_factory=list)


@dataclass(frozen=True)
class Watch(AgentMessage):
    """Rank ``rank`` registered as process ``pid`` on the agent's host: tell the session when it is gone."""

    TYPE: ClassVar[str] = "watch"
    rank: int = 0
    pid: int = 0


@dataclass(frozen=True)
class Kill(AgentMessage):
    """Send ``signal`` to launched process ``index``'s process group (``-1``: every one)."""

    TYPE: ClassVar[str] = "kill"
    index: int = -1
    signal: int = 15


@dataclass(frozen=True)
class DumpStacks(AgentMessage):
    """Signal these ranks (rank -> pid) for their Python stacks; answer with :class:`Stacks`."""

    TYPE: ClassVar[str] = "dump_stacks"
    req: int = 0
    ranks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Done(AgentMessage):
    """The run is over: stop whatever still runs, and exit."""

    TYPE: ClassVar[str] = "done"


# ---------------------------------------------------------------- both ways


@dataclass(frozen=True)
class Heartbeat(AgentMessage):
    TYPE: ClassVar[str] = "heartbeat"


def encode(msg: AgentMessage) -> bytes:
    """``msg`` as one JSON frame, as the wire codec writes every message."""
    return s.encode(msg)


def decode(data: bytes) -> AgentMessage:
    """The agent message in ``data``; raise :class:`wire.messages.SchemaError` if it is not a well-formed one."""
    return s.decode(data, AGENT_TYPES, MAX_AGENT_MESSAGE_BYTES)
