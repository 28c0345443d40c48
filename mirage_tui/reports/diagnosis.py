"""Turn the daemon's hang finding into a report a person can act on.

The daemon knows who is missing from which collective; the session knows the
rest: each rank's pid, what its process is doing, the last line it printed,
and (by signalling it) its Python stacks. This module puts the two together,
writes ``hang-report.json`` and ``stacks.txt`` into the run directory and
renders the text batch mode prints and the console shows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil

from wire.schema import STACK_SIGNAL, CollOp, HangDetected, HangKind


@dataclass(frozen=True)
class RankState:
    """What a rank was doing when the hang was reported."""

    rank: int
    pid: int | None
    process: str  # psutil status ("sleeping", "running", ...) or "exited"/"unknown"
    last_output: str
    last_output_age_s: float | None
    stacks: str
    host: str = ""  # the machine its process runs on, in a multi-host run


@dataclass(frozen=True)
class HangDiagnosis:
    finding: HangDetected
    ranks: dict[int, RankState]
    comm_label: str = ""  # the communicator as torch names it (``RunState.comm_label``); "" if unknown

    @property
    def label(self) -> str:
        """The communicator's name in the report's text: torch's, else its id's first characters."""
        return self.comm_label or self.finding.comm[:8]

    def to_json(self) -> dict:
        f = self.finding
        return {
            "kind": f.kind.value,
            "comm": f.comm,
            "comm_label": self.label if f.kind is HangKind.COLLECTIVE else None,
            "seq": f.seq,
            "op": f.op.name,
            "dtype": f.dtype,
            "numel": f.numel,
            "size": f.size,
            "waited_s": f.waited_s,
            "joined": [{"rank": r, "site": site} for r, site in zip(f.joined, f.sites)],
            "missing": [
                {"rank": r, "last_enqueued": e, "last_completed": c}
                for r, e, c in zip(f.missing, f.last_enqueued, f.last_completed)
            ],
            "ranks": {str(r): asdict(s) for r, s in self.ranks.items()},
        }


def _ours(pid: int, session: str) -> bool:
    """Only signal processes of this session: pids come from ranks' Hello and can be recycled."""
    try:
        return psutil.Process(pid).environ().get("MIRAGE_SESSION") == session
    except (psutil.Error, OSError):
        return False


def dump_stacks(rank_pids: dict[int, int], ranks_dir: str, session: str, wait_s: float = 1.0) -> dict[int, str]:
    """Signal every live rank for its stacks; return what each appended to its ``.stacks`` file."""
    def path(rank: int) -> str:
        return os.path.join(ranks_dir, f"rank-{rank}.stacks")

    def size(rank: int) -> int:
        return os.path.getsize(path(rank)) if os.path.exists(path(rank)) else 0

    before: dict[int, int] = {}
    for rank, pid in rank_pids.items():
        if not _ours(pid, session):
            continue
        before[rank] = size(rank)
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    # faulthandler writes from its C signal handler, even in a rank blocked in C: usually within
    # milliseconds; a rank that never answers (gone, or stopped) costs at most wait_s
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(size(r) == b for r, b in before.items()):
        time.sleep(0.02)
    # a dump is written thread by thread, and under load a rank's can take longer than a moment:
    # read once no file has grown for 60 ms (a loaded suite once read only the first thread)
    sizes = {r: size(r) for r in before}
    settle = time.monotonic() + wait_s
    while time.monotonic() < settle:
        time.sleep(0.06)
        now = {r: size(r) for r in before}
        if now == sizes:
            break
        sizes = now
    stacks = {}
    for rank, offset in before.items():
        try:
            with open(path(rank), errors="replace") as f:
                f.seek(offset)
                stacks[rank] = f.read().rstrip()
        except OSError:
            stacks[rank] = ""
    return stacks


def process_status(pid: int | None) -> str:
    """What psutil says process ``pid`` is doing (\"sleeping\", \"running\"...), or \"exited\"."""
    if pid is None:
        return "unknown (never registered)"
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "exited"
    except psutil.Error:
        return "unknown"


#: Asks other hosts about their ranks (rank -> pid): rank -> (process status, stacks).
Remote = Callable[[dict[int, int]], dict[int, tuple[str, str]]]


def diagnose(
    finding: HangDetected,
    rank_pids: dict[int, int],
    last_output: dict[int, tuple[str, float]],
    ranks_dir: str,
    session: str,
    comm_label: str = "",
    rank_hosts: dict[int, str] | None = None,
    remote: Remote | None = None,
) -> HangDiagnosis:
    """Gather each rank's state for ``finding`` (signals the ranks for their stacks); ``comm_label`` names its
    communicator as the reader's fold does. In a multi-host run ``rank_hosts`` says where each rank runs, and
    ``remote`` asks the agents of the other hosts for their ranks' state (here only this host's are signalled)."""
    rank_hosts = rank_hosts or {}
    elsewhere = {r: p for r, p in rank_pids.items() if rank_hosts.get(r, "") not in ("", socket.gethostname())}
    local = {r: p for r, p in rank_pids.items() if r not in elsewhere}
    stacks = dump_stacks(local, ranks_dir, session)
    states = {r: (process_status(p), stacks.get(r, "")) for r, p in local.items()}
    if elsewhere and remote is not None:
        states.update(remote(elsewhere))
    now = time.time()
    ranks = {}
    for rank in sorted(set(finding.joined) | set(finding.missing)):
        text, at = last_output.get(rank, ("", None))
        process, rank_stacks = states.get(rank, (process_status(None) if rank not in rank_pids else "unknown", ""))
        ranks[rank] = RankState(
            rank=rank,
            pid=rank_pids.get(rank),
            process=process,
            last_output=text,
            last_output_age_s=None if at is None else round(now - at, 1),
            stacks=rank_stacks,
            host=rank_hosts.get(rank, ""),
        )
    return HangDiagnosis(finding, ranks, comm_label)


def _innermost_user_frame(stacks: str) -> str:
    """The innermost frame outside torch and mirage of the "Current thread" block.

    faulthandler dumps from its C handler and marks the thread the kernel delivered
    the signal to; a process-directed signal goes to the main thread unless it
    blocks signals, which Python does not, so this is normally the main thread.
    """
    for block in stacks.split("\n\n"):
        if block.lstrip().startswith("Current thread"):
            for line in block.splitlines()[1:]:
                line = line.strip()
                if line.startswith("File ") and not _internal(line):
                    return line
    return ""


def _internal(frame_line: str) -> bool:
    """Whether a faulthandler frame line (``File "PATH", line N in NAME``) is in torch or the shim.

    The path is compared as written and with its links resolved: a virtual environment reached
    through a symlink names its files one way in the rank and the other in ``find_spec``.
    """
    path = frame_line.split('"')[1] if frame_line.count('"') >= 2 else frame_line
    return any(path.startswith(d) for d in _INTERNAL_DIRS) or any(
        os.path.realpath(path).startswith(d) for d in _INTERNAL_DIRS)


def _package_dirs(*names: str) -> tuple[str, ...]:
    # find_spec locates a top-level package without importing it (the console never imports torch)
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            for d in spec.submodule_search_locations:
                dirs.extend({os.path.join(d, ""), os.path.join(os.path.realpath(d), "")})
    return tuple(dirs)


#: Frames in these folders are the machinery, not the user's code.
_INTERNAL_DIRS = _package_dirs("torch", "shim")


def render(d: HangDiagnosis) -> str:
    """The report as text, in Flight Recorder's and NCCL's wording where they have one."""
    f = d.finding
    if f.kind is HangKind.WORLD:
        return _render_world(d)
    what = "message" if f.op in (CollOp.SEND, CollOp.RECV) else "collective"
    lines = [
        f"HANG: {what} #{f.seq} ({f.op.name}, {f.numel} x {f.dtype}) of communicator {d.label} "
        f"({f.size} ranks) has waited {f.waited_s:.1f} s",
        f"  joined ranks: {{{', '.join(map(str, f.joined))}}}",
        f"  missing ranks: {{{', '.join(map(str, f.missing))}}}",
    ]
    for rank, site in zip(f.joined, f.sites):
        lines.append(f"  [{rank}] joined {what} #{f.seq} at {site or '?'}")
    p2p = what == "message"
    for rank, enq, done in zip(f.missing, f.last_enqueued, f.last_completed):
        if p2p:
            other = "recv" if f.op is CollOp.SEND else "send"
            lines.append(f"  [{rank}] never posted the matching {other} (message #{f.seq} between the two)")
        elif enq == 0:
            lines.append(f"  [{rank}] never joined any collective of this communicator")
        elif enq > done:
            lines.append(f"  [{rank}] joined but didn't finish collective #{enq} (count from 1)")
        else:
            lines.append(f"  [{rank}] finished collective #{done}, but didn't join collective #{f.seq}")
        lines += _rank_lines(d.ranks.get(rank))
    return "\n".join(lines)


def _rank_lines(s: RankState | None) -> list[str]:
    """A rank's process, last output and where its main thread is now."""
    if s is None:
        return []
    pid = "?" if s.pid is None else s.pid
    where = f" on {s.host}" if s.host else ""
    lines = [f"      process {pid}{where}: {s.process}"]
    if s.last_output_age_s is not None:
        lines.append(f"      last output {s.last_output_age_s:.1f} s ago: {s.last_output}")
    frame = _innermost_user_frame(s.stacks)
    if frame:
        lines.append(f"      now at: {frame}")
    return lines


def _render_world(d: HangDiagnosis) -> str:
    """A world that never formed: who waits in init_process_group, who never arrived."""
    f = d.finding
    lines = [
        f"HANG: world formation (init_process_group) of {f.comm} ({f.size} ranks) has waited {f.waited_s:.1f} s "
        f"for {len(f.missing)} rank(s)",
        f"  joined ranks: {{{', '.join(map(str, f.joined))}}}",
        f"  missing ranks: {{{', '.join(map(str, f.missing))}}}",
    ]
    for rank, site in zip(f.joined, f.sites):
        lines.append(f"  [{rank}] waits in init_process_group at {site or '?'}")
        lines += _rank_lines(d.ranks.get(rank))
    for rank in f.missing:
        lines.append(f"  [{rank}] rank {rank} never registered: it did not reach init_process_group")
        lines += _rank_lines(d.ranks.get(rank))
    return "\n".join(lines)


def write(d: HangDiagnosis, run_dir: str) -> str:
    """Add the diagnosis to ``hang-report.json`` and the stacks to ``stacks.txt``; return the JSON path."""
    path = os.path.join(run_dir, "hang-report.json")
    reports = []
    if os.path.exists(path):
        with open(path) as f:
            reports = json.load(f)
    reports.append(d.to_json())
    with open(path, "w") as f:
        json.dump(reports, f, indent=2)
    with open(os.path.join(run_dir, "stacks.txt"), "a") as f:
        what = (f"world formation of {d.finding.comm}" if d.finding.kind is HangKind.WORLD
                else f"collective #{d.finding.seq} of communicator {d.label}")
        f.write(f"=== hang: {what} ===\n")
        for rank, s in d.ranks.items():
            f.write(f"--- rank {rank} (pid {s.pid}, {s.process}) ---\n{s.stacks or '(no stacks)'}\n\n")
    return path
