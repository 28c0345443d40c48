"""PyTorch Flight Recorder dumps of a run, for torch's own analyzer.

ProcessGroupNCCL keeps a ring buffer of every collective it posts and, on a
timeout, writes it to ``<prefix><global rank>``: a pickled dict that
``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX`` merges
across ranks to name the collective some rank never joined. The daemon's event
stream holds the same facts (who enqueued which collective, when it started and
completed), so we fold it into one such dump per global rank and people can use
the tool they already know on an emulated run.

The layout follows torch 2.13's ``FlightRecorderDetail.hpp`` (``dump()`` and
``getCollectiveTrace``). Values are plain Python data, so the files load
without mirage or torch.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field

from mirage_tui.state.runstate import read_journal
from wire import schema as s

#: The dump format version torch 2.13 writes (``version_val`` in
#: FlightRecorder.hpp); the analyzer picks its matching logic by it.
VERSION = "2.10"
#: The folder ``dump_run`` writes into, inside the run directory.
DUMP_DIR = "flight-recorder"
#: ProcessGroupNCCL's default collective timeout (10 minutes): the event stream
#: does not carry the group's timeout, and FR records one per entry.
DEFAULT_TIMEOUT_MS = 10 * 60 * 1000

#: Entries kept per rank (TORCH_NCCL_TRACE_BUFFER_SIZE's usual setting).
TRACE_BUFFER = 2000
#: File name prefix of the dumps (torch's default TORCH_NCCL_DEBUG_INFO_TEMP_FILE basename).
PREFIX = "nccl_trace_rank_"

#: ProcessGroupNCCL's profiling names. Our shim cannot tell ``all_gather`` from
#: ``all_gather_into_tensor`` (both arrive as one ALLGATHER of a flat buffer);
#: the list forms' names are the ones the analyzer checks sizes for
#: (input numel x group size == output numel), so a size mismatch still shows.
PROFILING_NAME = {
    s.CollOp.ALLREDUCE: "nccl:all_reduce",
    s.CollOp.BROADCAST: "nccl:broadcast",
    s.CollOp.ALLGATHER: "nccl:all_gather",
    s.CollOp.REDUCE_SCATTER: "nccl:reduce_scatter",
    s.CollOp.REDUCE: "nccl:reduce",
    s.CollOp.GATHER: "nccl:gather",
    s.CollOp.SCATTER: "nccl:scatter",
    s.CollOp.ALLTOALL: "nccl:all_to_all_single",
    s.CollOp.BARRIER: "nccl:all_reduce_barrier",
}

#: torch dtype names (``str(dtype)`` less ``torch.``) -> ``c10::toString(ScalarType)``.
DTYPE_NAME = {
    "float32": "Float",
    "float64": "Double",
    "float16": "Half",
    "bfloat16": "BFloat16",
    "int64": "Long",
    "int32": "Int",
    "int16": "Short",
    "int8": "Char",
    "uint8": "Byte",
    "uint16": "UInt16",
    "uint32": "UInt32",
    "uint64": "UInt64",
    "bool": "Bool",
    "complex32": "ComplexHalf",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
    "float8_e4m3fn": "Float8_e4m3fn",
    "float8_e4m3fnuz": "Float8_e4m3fnuz",
    "float8_e5m2": "Float8_e5m2",
    "float8_e5m2fnuz": "Float8_e5m2fnuz",
}


@dataclass
class _Group:
    """One communicator, as the process group FR would have recorded it."""

    pg_id: int
    name: str
    desc: str
    size: int
    global_of: dict[int, int] = field(default_factory=dict)  # communicator rank -> global rank
    started: dict[int, float] = field(default_factory=dict)  # seq -> time
    completed: dict[int, tuple[float, float]] = field(default_factory=dict)  # seq -> (time, seconds)


@dataclass(frozen=True)
class _Call:
    """One rank's post of one collective."""

    group: _Group
    global_rank: int
    event: s.CollectiveEnqueued


def _ns(t: float) -> int:
    ns = t * 1e9
    return int(ns) if abs(ns) < 2**63 else 0  # a hand-edited journal may hold any float


def _frames(site: str) -> list[dict]:
    """``file:line:function`` as FR's frame list (the file name may itself hold colons)."""
    parts = site.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return []
    filename, line, name = parts
    return [{"name": name, "filename": filename, "line": int(line)}]


def _tensors(call: _Call) -> tuple[list[list[int]], str, list[list[int]]]:
    """Input sizes, dtype name and output sizes of a call (one flat tensor each way)."""
    e = call.event
    dtype = DTYPE_NAME.get(e.dtype, e.dtype)
    if e.op is s.CollOp.BARRIER:
        # NCCL has no barrier: ProcessGroupNCCL all-reduces one float, and FR records that tensor
        return [[1]], "Float", [[1]]
    out, size = e.numel, max(call.group.size, 1)
    if e.op in (s.CollOp.ALLGATHER, s.CollOp.GATHER):
        out = e.numel * size
    elif e.op is s.CollOp.REDUCE_SCATTER:
        out = e.numel // size
    return [[e.numel]], dtype, [[out]]


def _entry(record_id: int, call: _Call) -> dict:
    """The FR entry of one call, in the state its communicator reached."""
    g, e = call.group, call.event
    inputs, dtype, outputs = _tensors(call)
    started = g.started.get(e.seq)
    completed = g.completed.get(e.seq)
    state = "completed" if completed else "started" if started is not None else "scheduled"
    entry = {
        "record_id": record_id,
        "pg_id": g.pg_id,
        "process_group": (g.name, g.desc),
        "collective_seq_id": e.seq,
        "p2p_seq_id": 0,
        # no coalescing here, so the per-group op counter moves with the collective one
        "op_id": e.seq,
        "profiling_name": PROFILING_NAME[e.op],
        "time_created_ns": _ns(e.t),
        "input_sizes": inputs,
        "input_dtypes": [dtype],
        "output_sizes": outputs,
        "output_dtypes": [dtype],
        "state": state,
        "time_discovered_started_ns": _ns(started) if started is not None else None,
        "time_discovered_completed_ns": _ns(completed[0]) if completed else None,
        # the watchdog retires a work item once it has seen it complete
        "retired": completed is not None,
        "timeout_ms": DEFAULT_TIMEOUT_MS,
        "is_p2p": False,
        "frames": _frames(e.site),
    }
    if completed:
        entry["duration_ms"] = completed[1] * 1000.0
    return entry


def _fold(events: Iterable[s.Event]) -> tuple[dict[str, _Group], list[_Call], set[int]]:
    """Communicators (in order of first join), calls (in order posted) and every global rank seen."""
    groups: dict[str, _Group] = {}
    calls: list[_Call] = []
    ranks: set[int] = set()
    for e in events:
        if isinstance(e, s.RankRegistered):
            ranks.add(e.rank)
        elif isinstance(e, s.CommJoined):
            g = groups.get(e.comm)
            if g is None:
                # torch's names as the ranks sent them; a journal without them: torch names groups "0", "1",
                # ... in creation order, the first being the default group
                n = len(groups)
                g = groups[e.comm] = _Group(n, e.name or str(n), e.desc or ("default_pg" if n == 0 else "undefined"),
                                            e.size)
            g.global_of[e.rank] = e.global_rank
            ranks.add(e.global_rank)
        elif isinstance(e, s.CollectiveEnqueued):
            g = groups.get(e.comm)
            # a post from a rank that never joined cannot be placed in anyone's dump;
            # point-to-point has no collective entry in this layout
            if g is not None and e.rank in g.global_of and e.op in PROFILING_NAME:
                calls.append(_Call(g, g.global_of[e.rank], e))
        elif isinstance(e, s.CollectiveStarted):
            if e.comm in groups:
                groups[e.comm].started.setdefault(e.seq, e.t)
        elif isinstance(e, s.CollectiveCompleted):
            if e.comm in groups:
                groups[e.comm].completed.setdefault(e.seq, (e.t, e.seconds))
    return groups, calls, ranks


def _dump(rank: int, groups: dict[str, _Group], calls: list[_Call]) -> dict:
    """The dump one rank's ProcessGroupNCCL would have written."""
    mine = [g for g in groups.values() if rank in g.global_of.values()]
    # the last TRACE_BUFFER entries, as Flight Recorder's ring buffer keeps them
    mine_calls = [c for c in calls if c.global_rank == rank][-TRACE_BUFFER:]
    entries = [_entry(i, c) for i, c in enumerate(mine_calls)]
    status = {}
    for g in mine:
        # FR's counters start at -1 (nothing yet); started/completed are communicator-wide here
        posted = {e["collective_seq_id"] for e in entries if e["pg_id"] == g.pg_id}
        status[str(g.pg_id)] = {
            "last_enqueued_collective": max(posted, default=-1),
            "last_started_collective": max((q for q in g.started if q in posted), default=-1),
            "last_completed_collective": max((q for q in g.completed if q in posted), default=-1),
        }
    return {
        "version": VERSION,
        "pg_config": {
            # ranks as FR prints them ("[0, 1]"): the analyzer parses the string
            g.name: {"name": g.name, "desc": g.desc, "ranks": str(sorted(g.global_of.values()))}
            for g in mine
        },
        "pg_status": status,
        "entries": entries,
    }


def write_dumps(events: Iterable[s.Event], out_dir: str, prefix: str = PREFIX) -> list[str]:
    """Write one Flight Recorder dump per global rank of ``events`` into ``out_dir``.

    Each file is ``<out_dir>/<prefix><global rank>``, a pickle in the layout
    torch 2.13's ProcessGroupNCCL writes, so
    ``python -m torch.distributed.flight_recorder.fr_trace out_dir -p prefix``
    analyses it. Returns the paths written, by rank.
    """
    groups, calls, ranks = _fold(events)
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    paths = []
    for rank in sorted(ranks):
        path = os.path.join(out_dir, f"{prefix}{rank}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(_dump(rank, groups, calls), f)
        paths.append(path)
    return paths


def dump_run(run_dir: str) -> str:
    """Write Flight Recorder dumps of the run in ``run_dir`` into its ``flight-recorder/`` folder; return that folder."""
    out_dir = os.path.join(run_dir, DUMP_DIR)
    write_dumps(read_journal(os.path.join(run_dir, "events.jsonl")), out_dir)
    return out_dir
