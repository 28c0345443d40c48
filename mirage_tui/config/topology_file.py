"""Topologies saved as TOML: the last run's (``.mirage/last-topology.toml``) and any the user keeps.

No Textual here. Loading checks every field's type and names the bad one; the
values themselves are checked by :func:`mirage_tui.config.topology.validate`, as the
command line's are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib

from mirage_tui.config.topology import ExecMode, ProgramClock, Topology, UsageError

#: Where the console keeps the topology of the last run it started (next to ``.mirage/runs``).
LAST_PATH = os.path.join(".mirage", "last-topology.toml")

# field -> the TOML type it must have (a float field also takes an integer)
_TYPES: dict[str, type] = {"profile": str, "num_nodes": int, "gpus_per_node": int, "in_process": bool,
                           "hang_timeout_s": float, "hbm_bytes": int, "exec_mode": str, "program_clock": str,
                           "command": list,
                           "nproc_per_node": int, "workdir": str, "clear_env": bool, "debug_rank": int, "env": dict}


def dumps(topology: Topology) -> str:
    """The saved form of ``topology`` (what the Setup form sets; log dir, faults and report are per run)."""
    def q(value: str) -> str:
        return json.dumps(value)  # a JSON string is a valid TOML basic string

    lines = [
        "# a mirage topology: mirage-tui loads it into the Setup form",
        f"profile = {q(topology.profile)}",
        f"num_nodes = {topology.num_nodes}",
        f"gpus_per_node = {topology.gpus_per_node}",
        f"hang_timeout_s = {float(topology.hang_timeout_s)!r}",
        f"in_process = {str(topology.in_process).lower()}",
        f"exec_mode = {q(topology.exec_mode.value)}",
        f"program_clock = {q(topology.program_clock.value)}",
        # TOML has no null: a flag not given has no line (the profile's HBM, the launcher's ranks, ...)
        *([f"hbm_bytes = {topology.hbm_bytes}"] if topology.hbm_bytes is not None else []),
        f"command = [{', '.join(q(a) for a in topology.command)}]",
        *([f"nproc_per_node = {topology.nproc_per_node}"] if topology.nproc_per_node is not None else []),
        *([f"workdir = {q(topology.workdir)}"] if topology.workdir is not None else []),
        f"clear_env = {str(topology.clear_env).lower()}",
        *([f"debug_rank = {topology.debug_rank}"] if topology.debug_rank is not None else []),
        "",
        "[env]",
        *(f"{q(k)} = {q(v)}" for k, v in topology.env),
    ]
    return "\n".join(lines) + "\n"


def save(topology: Topology, path: str = LAST_PATH) -> None:
    """Write ``topology`` to ``path`` (its folder is created, private to the user as run dirs are)."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps(topology))


def load(path: str, base: Topology | None = None) -> Topology:
    """Read a saved topology over ``base`` (fields it lacks keep ``base``'s); raise :class:`UsageError`."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"cannot read topology file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"topology file {path} is not valid TOML: {e}") from None
    changes: dict[str, object] = {}
    for key, value in data.items():
        want = _TYPES.get(key)
        if want is None:
            raise UsageError(f"topology file {path}: unknown key {key!r} (known: {', '.join(_TYPES)})")
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if ok and want is list:
            ok = all(isinstance(a, str) for a in value)
            value = tuple(value)
        if ok and want is dict:
            ok = all(isinstance(v, str) for v in value.values())
            value = tuple(value.items())
        if not ok:
            raise UsageError(f"topology file {path}: {key} must be a {want.__name__} "
                             f"{'of strings ' if want in (list, dict) else ''}(got {value!r})")
        if key == "exec_mode":
            try:
                value = ExecMode(value)
            except ValueError:
                raise UsageError(f"topology file {path}: exec_mode must be one of "
                                 f"{', '.join(m.value for m in ExecMode)} (got {value!r})") from None
        if key == "program_clock":
            try:
                value = ProgramClock(value)
            except ValueError:
                raise UsageError(f"topology file {path}: program_clock must be one of "
                                 f"{', '.join(c.value for c in ProgramClock)} (got {value!r})") from None
        changes[key] = value
    return dataclasses.replace(base or Topology(), **changes)
