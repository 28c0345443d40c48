"""``mirage sessions``, ``stop``, ``exec`` and ``cleanup``: list the live sessions of this machine, end one
as Ctrl-C would, run a command in one's environment, remove what killed ones left."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time

from mirage_tui.commands import cleanup
from mirage_tui.config.topology import CommandNotFound, UsageError
from mirage_tui.hosts import protocol as ap
from mirage_tui.session import registry as sessions


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def list_sessions(as_json: bool, show_all: bool) -> int:
    """Print the live sessions (``show_all``: the dead ones too) as a table or a JSON array."""
    now = time.time()
    rows = []
    for entry in sessions.entries():
        alive = entry.alive
        if not alive and not show_all:
            continue
        try:
            state = sessions.run_state(entry) if alive else "dead"
        except OSError:
            state = "starting"  # its journal is not there yet
        rows.append((entry, state, now - entry.started))
    if as_json:
        print(json.dumps([{**e.to_json(), "state": state, "age_s": round(age, 1)} for e, state, age in rows],
                         indent=1))
        return 0
    if not rows:
        print("no mirage session" if show_all else "no live mirage session (--all also lists dead ones)")
        return 0
    header = ("SESSION", "STATE", "AGE", "PID", "TOPOLOGY", "PROFILE", "COMMAND")
    table = [header] + [
        (e.session, state, _age(age), str(e.pid), f"{e.num_nodes}x{e.gpus_per_node}"
         + (f" {e.exec_mode}" if e.exec_mode != "functional" else ""), e.profile, shlex.join(e.command))
        for e, state, age in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if any(state == "dead" for _, state, _ in rows):
        print("dead: its owner was killed; 'mirage cleanup' removes what it left", file=sys.stderr)
    return 0


def stop_session(what: str, timeout: float) -> int:
    """End the live session ``what`` as Ctrl-C in its terminal would; wait for its owner to finish."""
    entry = sessions.find(what)
    print(f"mirage: stopping session {entry.session} (pid {entry.pid}, run dir {entry.run_dir})", file=sys.stderr)
    if not sessions.stop(entry, timeout):
        print(f"mirage: session {entry.session} did not end within {timeout:g} s (pid {entry.pid} still runs)",
              file=sys.stderr)
        return 1
    print(f"mirage: session {entry.session} ended; its report: {entry.run_dir}/report.json", file=sys.stderr)
    return 0


def clean_up(dry_run: bool) -> int:
    """List what dead sessions left and (unless ``dry_run``) remove it; 1 if something could not be removed."""
    items = cleanup.find()
    if not items:
        print("mirage: nothing to clean up: no dead session in the registry "
              f"({sessions.registry_dir()})", file=sys.stderr)
        return 0
    dead = len({item.session for item in items})
    if dry_run:
        for item in items:
            print(f"would remove  {item}")
        print(f"mirage: {len(items)} item(s) of {dead} dead session(s); run without --dry-run to remove them",
              file=sys.stderr)
        return 0
    failed = 0
    for item, error in cleanup.remove(items):
        print(f"removed  {item}" if error is None else f"FAILED   {item}: {error}")
        failed += error is not None
    print(f"mirage: cleaned up {dead} dead session(s): {len(items) - failed} item(s) removed"
          + (f", {failed} could not be" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def _on_host(env: dict[str, str], host: str, command: tuple[str, ...]) -> list[str]:
    """``command`` as a step of the run's Slurm job on ``host`` (a node of a ``--launcher slurm`` run there):
    ``srun --overlap`` beside the job's own steps, with the node's environment (``--export=ALL``)."""
    job, index = env.get("SLURM_JOB_ID"), env.get(ap.SLURM_INDEX)
    if not job or index is None:
        raise UsageError(f"this node runs on {host}, and its environment names no Slurm job to reach it through")
    return ["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1", f"--relative={index}",
            "--export=ALL", "--quiet", *command]


def exec_in(what: str, node: int, command: tuple[str, ...] | None) -> int:
    """Run ``command`` in node ``node``'s environment of the live session ``what``; its exit code.

    It sees the node's emulated GPUs (``torch.cuda``), its run directory and variables, as a process
    the node started would; ``MIRAGE_EXEC=1`` makes ``init_process_group`` refuse: it is not a rank. A node
    on another host of a ``--launcher slurm`` run is reached with ``srun`` inside the run's job.
    """
    if not command:
        raise UsageError("'mirage exec SESSION [--node N] -- COMMAND [ARGS...]' needs a command after --")
    entry = sessions.find(what)
    env = sessions.read_node_env(entry, node)
    env["MIRAGE_EXEC"] = "1"
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):  # not one of the ranks
        env.pop(key, None)
    host = env.get(ap.HOST_TAG)
    if host is not None and host != socket.gethostname():
        command = _on_host(env, host, command)
    try:
        return subprocess.run(list(command), env=env, cwd=os.getcwd()).returncode
    except (FileNotFoundError, PermissionError) as e:
        what_is_wrong = "not found" if isinstance(e, FileNotFoundError) else "not executable"
        raise CommandNotFound(f"command {what_is_wrong}: {command[0]} (searched PATH)") from None
    except KeyboardInterrupt:
        return 130
