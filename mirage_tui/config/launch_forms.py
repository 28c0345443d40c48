"""The Setup form's launch forms: the program run under torchrun on every node, or run directly.

The form keeps one source of truth, the full command line each node process
runs (what ``mirage run -- COMMAND`` takes); these functions read a launch form
and a program out of such a command and write one back. No Textual here.
"""

from __future__ import annotations

import os
import shlex
import sys

TORCHRUN = "torchrun"
DIRECT = "direct"
#: torchrun flags written with a separate value (``--nproc-per-node 8``), so the value is skipped too.
_VALUE_FLAGS = {f"--{name}" for flag in (
    "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
    "rdzv_id", "rdzv_conf", "max_restarts", "log_dir", "tee", "redirects", "role", "monitor_interval",
) for name in (flag, flag.replace("_", "-"))}
#: A multi-node torchrun needs each node's rank and the head's address, which only exist at launch
#: (mirage sets RANK, MASTER_ADDR and MASTER_PORT per node): a shell expands them there.
_MULTI_NODE = ("exec {torchrun} --nnodes=$WORLD_SIZE --node_rank=$RANK --nproc_per_node={gpus} "
               "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT {program}")


def _unwrap(command: tuple[str, ...]) -> list[str]:
    """The command a ``sh -c 'exec ...'`` wrapper runs, else the command itself."""
    argv = list(command)
    if len(argv) == 3 and os.path.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
        try:
            inner = shlex.split(argv[2])
        except ValueError:
            return argv
        return inner[1:] if inner[:1] == ["exec"] else inner
    return argv


def _is_torchrun(argv: list[str]) -> bool:
    if not argv:
        return False
    return os.path.basename(argv[0]) == "torchrun" or argv[1:3] == ["-m", "torch.distributed.run"]


def launch_form(command: tuple[str, ...]) -> str:
    """:data:`TORCHRUN` when the command runs torchrun (plainly or through ``sh -c``), else :data:`DIRECT`."""
    return TORCHRUN if _is_torchrun(_unwrap(command)) else DIRECT


def program(command: tuple[str, ...]) -> list[str]:
    """The program and its arguments, without the launcher (torchrun and its flags, or python and its)."""
    argv = _unwrap(command)
    if _is_torchrun(argv):
        rest = argv[3:] if argv[1:2] == ["-m"] else argv[1:]
    elif argv and os.path.basename(argv[0]).startswith("python"):
        rest = argv[1:]
    else:
        return argv
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        i += 2 if rest[i] in _VALUE_FLAGS else 1
    return rest[i:]


def _launcher(command: tuple[str, ...], form: str) -> str:
    """Keep the launcher the command already names; otherwise the one next to this interpreter."""
    argv = _unwrap(command)
    if form == TORCHRUN:
        if argv and os.path.basename(argv[0]) == "torchrun":
            return argv[0]
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        return torchrun if os.path.exists(torchrun) else "torchrun"
    if argv and os.path.basename(argv[0]).startswith("python"):
        return argv[0]
    return sys.executable


def build(form: str, command: tuple[str, ...], num_nodes: int, gpus_per_node: int) -> tuple[str, ...]:
    """``command``'s program under launch form ``form`` for this topology."""
    prog = program(command)
    launcher = _launcher(command, form)
    if form == DIRECT:
        return (launcher, *prog)
    if num_nodes == 1:
        return (launcher, "--standalone", f"--nproc_per_node={gpus_per_node}", *prog)
    inner = _MULTI_NODE.format(torchrun=shlex.quote(launcher), gpus=gpus_per_node, program=shlex.join(prog))
    return ("sh", "-c", inner)
