"""What a run asks for: the emulated cluster's shape and the program to run.

The command line builds a :class:`Topology`; :func:`validate` checks it before
anything starts, so every usage mistake surfaces as one :class:`UsageError`
line instead of a half-started run; :func:`check_combination` and
:func:`check_command` add the checks that look past one flag (flags that
contradict each other, the program on the nodes' PATH). The command line and
the console's Setup form both run all three.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from enum import Enum

from wire.faults import Fault
from wire.profiles import DEFAULT_PROFILE, ProfileError, load_profile

MAX_GPUS_PER_NODE = 64
MAX_NODES = 1024
#: The most rank processes ``--nproc-per-node`` starts on one node.
MAX_NPROC_PER_NODE = 64
#: What ``--clear-env-vars`` keeps of mirage's own environment (and every ``LC_*``): who and where the
#: user is, how text is written. ``--env`` and the variables mirage sets for the shim come on top.
CLEARED_ENV_KEEPS = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "LANGUAGE", "TZ", "TMPDIR")


def kept_env(environ: dict[str, str]) -> dict[str, str]:
    """The part of ``environ`` that ``--clear-env-vars`` keeps."""
    return {k: v for k, v in environ.items() if k in CLEARED_ENV_KEEPS or k.startswith("LC_")}

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


DEFAULT_HANG_TIMEOUT_S = 30.0


class OnHang(str, Enum):
    """What a run does once a hang has been reported."""

    EXIT = "exit"
    WAIT = "wait"


class ExecMode(str, Enum):
    """How the emulated GPUs run: right answers only; right answers on an emulated clock; or the clock and
    the memory without the values, at any size (docs/clocked.md)."""

    FUNCTIONAL = "functional"
    CLOCKED = "clocked"
    ESTIMATE = "estimate"

    @property
    def keeps_time(self) -> bool:
        """Whether the run keeps emulated time: clocked and estimate runs do."""
        return self is not ExecMode.FUNCTIONAL


class ProgramClock(str, Enum):
    """What the program's own ``time.perf_counter``/``monotonic``/``time`` read in a clocked run (docs/clocked.md)."""

    WALL = "wall"
    EMULATED = "emulated"


class Launcher(str, Enum):
    """Who starts the emulated nodes: mirage on this machine, or Slurm on the hosts of an allocation."""

    LOCAL = "local"
    SLURM = "slurm"


class UsageError(Exception):
    """A mistake in how mirage was called; the message is one line."""


class CommandNotFound(UsageError):
    """The program after ``--`` does not exist or cannot be executed (the command line exits 127)."""


@dataclass(frozen=True)
class Topology:
    """An emulated cluster of ``num_nodes`` x ``gpus_per_node`` GPUs and its workload."""

    profile: str = DEFAULT_PROFILE  # a bundled profile name or a .toml path
    num_nodes: int = 1
    gpus_per_node: int = 1
    env: tuple[tuple[str, str], ...] = ()  # extra environment for every rank
    in_process: bool = False
    log_dir: str | None = None
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    on_hang: OnHang = OnHang.EXIT
    faults: tuple[Fault, ...] = ()  # --inject
    report: str | None = None  # --report FILE: the run's JSON report, besides run_dir/report.json
    hbm_bytes: int | None = None  # --hbm: each GPU's memory instead of the profile's (rehearse OOM)
    command: tuple[str, ...] = ()  # the program and its own arguments
    exec_mode: ExecMode = ExecMode.FUNCTIONAL  # --exec-mode
    program_clock: ProgramClock = ProgramClock.WALL  # --program-clock: emulated needs exec_mode clocked
    # --nproc-per-node: mirage starts this many rank processes per node itself, with torchrun's
    # environment; None runs the command once per node (what torchrun or a framework then launches)
    nproc_per_node: int | None = None
    workdir: str | None = None  # --workdir: the folder the command runs in (default: mirage's own)
    clear_env: bool = False  # --clear-env-vars: the command starts from an almost empty environment
    debug_rank: int | None = None  # --debug-rank: this global rank waits for a debugger before its program runs
    # --launcher slurm: the nodes run on the hosts of the Slurm allocation, num_nodes / hosts on each
    launcher: Launcher = Launcher.LOCAL
    # --fork-server: ranks on this machine are forked from one process that imported torch once
    fork_server: bool = True

    @property
    def world_gpus(self) -> int:
        """How many GPUs the whole cluster has."""
        return self.num_nodes * self.gpus_per_node

    def max_ranks(self) -> tuple[int, str]:
        """How many ranks the run can have, and why: what mirage starts itself with ``--nproc-per-node``, one
        process with ``--in-process``, else (torchrun, or a launcher inside the program) one per GPU."""
        if self.in_process:
            return 1, "--in-process runs one process"
        if self.nproc_per_node is not None:
            return self.num_nodes * self.nproc_per_node, f"{self.num_nodes} node(s) x --nproc-per-node {self.nproc_per_node}"
        return self.world_gpus, f"{self.num_nodes} node(s) x {self.gpus_per_node} GPU(s)"


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*\Z", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS.update({_p: 1024**_i, f"{_p}ib": 1024**_i, f"{_p}i": 1024**_i, f"{_p}b": 1000**_i})


def parse_size(text: str) -> int:
    """Parse ``--hbm`` sizes such as ``8GiB``, ``512MiB``, ``80GB`` or bytes; raise :class:`UsageError`."""
    m = _SIZE.match(text)
    if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        raise UsageError(f"--hbm expects a size such as 8GiB, 512MiB or 80GB, got {text!r}")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if size <= 0:
        raise UsageError(f"--hbm must be above zero, got {text!r}")
    return size


def parse_env(item: str) -> tuple[str, str]:
    """Split one ``--env KEY=VALUE`` argument; raise :class:`UsageError` if malformed."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"--env expects KEY=VALUE, got {item!r}")
    _check_env_name(key)
    return key, value


def _check_env_name(key: str) -> None:
    if not _ENV_NAME.match(key):
        raise UsageError(f"--env name {key!r} is not a valid environment variable name")


def validate(topology: Topology) -> None:
    """Raise :class:`UsageError` naming the first problem with ``topology``, if any."""
    gpus = topology.gpus_per_node
    if not 1 <= gpus <= MAX_GPUS_PER_NODE:
        raise UsageError(f"--gpus-per-node must be between 1 and {MAX_GPUS_PER_NODE}, got {gpus}")
    if not 1 <= topology.num_nodes <= MAX_NODES:
        raise UsageError(f"--num-nodes must be between 1 and {MAX_NODES}, got {topology.num_nodes}")
    try:
        load_profile(topology.profile)
    except ProfileError as e:
        raise UsageError(str(e)) from None
    if not 0 < topology.hang_timeout_s <= 86400:
        raise UsageError(f"--hang-timeout must be a number of seconds above 0 (at most 86400), got {topology.hang_timeout_s:g}")
    for key, _ in topology.env:
        _check_env_name(key)
    nproc = topology.nproc_per_node
    if nproc is not None and not 1 <= nproc <= MAX_NPROC_PER_NODE:
        raise UsageError(f"--nproc-per-node must be between 1 and {MAX_NPROC_PER_NODE}, got {nproc}")
    if topology.workdir is not None:
        _check_workdir(topology.workdir)
    if topology.debug_rank is not None:
        ranks, why = topology.max_ranks()
        if not 0 <= topology.debug_rank < ranks:
            raise UsageError(f"--debug-rank must be a rank of the run, 0 to {ranks - 1} ({why}), "
                             f"got {topology.debug_rank}")
    if not topology.command:
        raise UsageError(
            "missing command: put the program after --, e.g. mirage run -- python train.py"
        )


def _check_workdir(workdir: str) -> None:
    if not workdir:
        raise UsageError("--workdir must name a directory, got ''")
    where = os.path.abspath(workdir)
    if not os.path.exists(workdir):
        raise UsageError(f"--workdir {workdir}: no such directory (tried {where})")
    if not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir}: not a directory (tried {where})")
    if not os.access(workdir, os.X_OK):
        raise UsageError(f"--workdir {workdir}: permission denied (tried {where})")


def _runs_torchrun(command: tuple[str, ...]) -> bool:
    """``torchrun ...`` or ``python -m torch.distributed.run ...`` (as ``shim.bootstrap`` tells its agent)."""
    return bool(command) and (
        os.path.basename(command[0]) == "torchrun"
        or any(a == "-m" and b in ("torch.distributed.run", "torch.distributed.launch")
               for a, b in zip(command, command[1:], strict=False))
    )


def check_combination(topology: Topology) -> None:
    """Flags that are each fine but contradict each other, and a --report that could never be written."""
    if topology.in_process and topology.num_nodes > 1:
        raise UsageError(
            f"--in-process runs without the daemon, so it cannot join --num-nodes {topology.num_nodes} nodes; "
            "drop one of the two"
        )
    nproc = topology.nproc_per_node
    if topology.in_process and nproc is not None and nproc > 1:
        raise UsageError(
            f"--in-process runs without the daemon, so its ranks cannot reach each other: --nproc-per-node {nproc} "
            "needs it; drop one of the two"
        )
    if nproc is not None and _runs_torchrun(topology.command):
        raise UsageError(
            "--nproc-per-node makes mirage start the ranks itself, and torchrun would start its own in each of "
            "them; drop --nproc-per-node (give torchrun its --nproc_per_node) or run the program without torchrun"
        )
    if topology.in_process and topology.on_hang is OnHang.WAIT:
        raise UsageError("--on-hang wait acts on the daemon's hang reports, and --in-process has no daemon; "
                         "drop one of the two")
    if topology.in_process and topology.exec_mode.keeps_time:
        raise UsageError(f"--exec-mode {topology.exec_mode.value} needs the daemon, which keeps the emulated clock "
                         "across ranks, and --in-process has none; drop one of the two")
    if topology.program_clock is ProgramClock.EMULATED and not topology.exec_mode.keeps_time:
        raise UsageError(f"--program-clock emulated reads the emulated clock, which --exec-mode "
                         f"{topology.exec_mode.value} does not keep; add --exec-mode clocked or drop --program-clock")
    if topology.launcher is Launcher.SLURM:
        if topology.in_process:
            raise UsageError("--launcher slurm runs nodes on other hosts, and --in-process runs one process here; "
                             "drop one of the two")
        if topology.debug_rank is not None:
            raise UsageError("--debug-rank listens on the rank's loopback, out of reach on another host; "
                             "drop it with --launcher slurm")
        hosts = slurm_hosts()
        if topology.num_nodes % hosts:
            raise UsageError(f"--num-nodes {topology.num_nodes} cannot be spread evenly over the allocation's "
                             f"{hosts} hosts; give a multiple of {hosts}")
    if topology.report:
        folder = os.path.dirname(os.path.abspath(topology.report))
        if os.path.isdir(topology.report) or not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"--report {topology.report}: cannot write a file there; pick a file in a writable folder")


def slurm_hosts() -> int:
    """How many hosts the Slurm allocation this runs in has; :class:`UsageError` outside one."""
    if not os.environ.get("SLURM_JOB_ID"):
        raise UsageError("--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is not set): "
                         "run it under salloc or in an sbatch script")
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or ""
    if not nodes.isdigit() or int(nodes) < 1:
        raise UsageError(f"--launcher slurm: SLURM_JOB_NUM_NODES is {nodes!r}, not a number of hosts")
    return int(nodes)


def check_command(topology: Topology) -> None:
    """Find the program the nodes will run, as they will (their PATH), before anything starts."""
    if not topology.command:
        return
    prog = topology.command[0]
    path = dict(topology.env).get("PATH", os.environ.get("PATH", os.defpath))
    if os.sep in prog and topology.workdir:  # a relative program path is found from the folder it runs in
        prog = os.path.join(topology.workdir, prog)
    if shutil.which(prog, path=path) is not None:
        return
    if os.sep in prog:
        where = os.path.abspath(prog)
        if not os.path.exists(where):
            raise CommandNotFound(f"command not found: {prog} (tried {where}: no such file)")
        why = "it is a directory" if os.path.isdir(where) else "it has no execute permission"
        raise CommandNotFound(f"command not executable: {prog} (tried {where}: {why})")
    for folder in path.split(os.pathsep):
        candidate = os.path.join(folder or ".", prog)
        if os.path.isfile(candidate):
            raise CommandNotFound(f"command not executable: {prog} (found {candidate}, which has no execute permission)")
    raise CommandNotFound(f"command not found: {prog} (searched PATH={path})")
