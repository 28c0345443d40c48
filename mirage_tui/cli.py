"""The ``mirage`` and ``mirage-tui`` commands.

Everything after the first ``--`` is the workload's command line and is split
off before argparse runs, so the workload's own flags are never parsed as
mirage's. Every usage mistake is one ``PROG: error: ...`` line on stderr and
exit status 2, and nothing is started. Batch mode must never import textual,
so this module imports the runner (and any UI) lazily.

Up to 700 lines on purpose: it is the one place both commands' flags are declared
and dispatched, and it imports almost nothing at import time; the work each
command does lives in the modules it imports lazily (commands.batch, commands.sessions, app).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from mirage_tui import __version__
from mirage_tui.config.topology import (
    CLEARED_ENV_KEEPS,
    DEFAULT_HANG_TIMEOUT_S,
    CommandNotFound,
    ExecMode,
    Launcher,
    OnHang,
    ProgramClock,
    Topology,
    UsageError,
    check_combination,
    check_command,
    parse_env,
    parse_size,
    slurm_hosts,
    validate,
)
from wire import faults
from wire.faults import Fault
from wire.profiles import (
    DEFAULT_PROFILE,
    PROFILE_DIR,
    Profile,
    ProfileError,
    create_user_profile,
    load_profile,
    parse_field,
    profile_names,
    profile_path,
    profile_values,
    user_profile_dir,
)

USAGE_EXIT = 2
#: The program after ``--`` cannot be run (a shell's answer); nothing was started.
COMMAND_NOT_FOUND_EXIT = 127


_RUN_EPILOG = """\
example:
  %(prog)s --gpus-per-node 8 -- torchrun --nproc-per-node 8 train.py
"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are exceptions, so they print as one line."""

    def __init__(self, **kwargs: Any) -> None:
        # No abbreviations: a later flag must not change what an old one means.
        super().__init__(allow_abbrev=False, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # Strict at every level, so a stray argument is reported by the
        # subcommand that met it and the hint names that subcommand's --help.
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            hint = "" if extras[0].startswith("-") else " (the program to run goes after --)"
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns, extras

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see '{self.prog} --help'")


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="NAME",
        help=f"GPU model to emulate: a built-in or user profile, or a profile .toml file "
        f"(default: {DEFAULT_PROFILE}; see 'mirage profiles')",
    )
    parser.add_argument("--num-nodes", type=int, default=None, metavar="N",
                        help="nodes (default: 1; with --launcher slurm, the allocation's hosts)")
    parser.add_argument(
        "--launcher",
        choices=[x.value for x in Launcher],
        default=Launcher.LOCAL.value,
        help="local: mirage starts every node on this machine (default); slurm: inside a Slurm allocation, "
        "the nodes run on its hosts, started with srun, one agent per host (docs/scaling.md)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, metavar="G", help="GPUs per node (default: 1; 2 for the demo)"
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N rank processes per node, with the environment torchrun gives its workers (RANK, "
        "LOCAL_RANK, WORLD_SIZE, ...), for a program launched without torchrun (default: run the command "
        "once per node)",
    )
    parser.add_argument(
        "--workdir", metavar="DIR", help="run the command in DIR (default: the current directory)"
    )
    parser.add_argument(
        "--clear-env-vars",
        action="store_true",
        help=f"start the command from an almost empty environment: only {', '.join(CLEARED_ENV_KEEPS)} and "
        "LC_* are kept, then --env and what mirage sets are added",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set an environment variable for the workload (repeatable)",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="run without the emulator daemon (single-process programs only)"
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT_S,
        metavar="SECONDS",
        help=f"report a collective some ranks joined and others did not after this long "
        f"(default: {DEFAULT_HANG_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--hbm",
        metavar="SIZE",
        help="memory of each emulated GPU instead of the profile's, e.g. 8GiB to rehearse out-of-memory",
    )
    parser.add_argument(
        "--report",
        metavar="FILE",
        help="also write the run's JSON report (exit codes, collectives, findings) to FILE",
    )
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="make a rank misbehave at a collective of its default group, e.g. "
        "'rank=1,seq=7,action=hang' (actions: hang, delay:2s, crash, skip; repeatable)",
    )
    parser.add_argument(
        "--on-hang",
        choices=[p.value for p in OnHang],
        default=OnHang.EXIT.value,
        help="after a hang report: stop the run (exit 124) or keep it running for inspection (default: exit)",
    )
    parser.add_argument(
        "--debug-rank",
        type=int,
        metavar="R",
        help="rank R stops before its program runs and waits for a debugger on a loopback port (pdb; "
        "MIRAGE_DEBUGGER=debugpy for an IDE, where debugpy is installed; the line to connect is printed); the "
        "other ranks run on, and a rank stopped in the debugger is not reported as a hang",
    )
    parser.add_argument(
        "--exec-mode",
        choices=[m.value for m in ExecMode],
        default=ExecMode.FUNCTIONAL.value,
        help="functional: right answers, no notion of time (default); clocked: also keep emulated time "
        "and predict step times on the profile's GPUs; estimate: the clock and the GPU memory without the "
        "values, so a model of any size runs: step time, memory, out-of-memory (docs/clocked.md)",
    )
    parser.add_argument(
        "--program-clock",
        choices=[c.value for c in ProgramClock],
        default=ProgramClock.WALL.value,
        help="with --exec-mode clocked or estimate: emulated makes the program's time.perf_counter, time.monotonic and "
        "time.time read the rank's emulated clock, so its own step times and tokens/s are the prediction; "
        "wall leaves them alone (default)",
    )
    parser.add_argument(
        "--fork-server",
        choices=["on", "off"],
        default="on",
        help="on: the ranks on this machine fork from one process that imported torch once (start-up in "
        "tens of ms, torch's memory shared; docs/scaling.md); off: each rank is a fresh interpreter, with "
        "its own hash seed (default: on)",
    )
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        help="where to write the run's logs (default: under .mirage/runs)",
    )


def _fault(spec: str) -> Fault:
    try:
        return faults.parse(spec)
    except faults.FaultError as e:
        raise UsageError(str(e)) from None


def _split(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...] | None]:
    """Split ``argv`` at the first ``--``; the command is None when there is no ``--``."""
    args = list(argv)
    if "--" not in args:
        return args, None
    cut = args.index("--")
    return args[:cut], tuple(args[cut + 1 :])


def _topology(ns: argparse.Namespace, command: tuple[str, ...] | None, help_prog: str) -> Topology:
    """Build and validate the run's topology; errors point at ``help_prog --help``."""
    try:
        launcher = Launcher(ns.launcher)
        num_nodes = ns.num_nodes
        if num_nodes is None:
            num_nodes = slurm_hosts() if launcher is Launcher.SLURM else 1
        topology = Topology(
            profile=ns.profile,
            num_nodes=num_nodes,
            gpus_per_node=1 if ns.gpus_per_node is None else ns.gpus_per_node,
            env=tuple(parse_env(item) for item in ns.env),
            in_process=ns.in_process,
            log_dir=ns.log_dir,
            hang_timeout_s=ns.hang_timeout,
            on_hang=OnHang(ns.on_hang),
            faults=tuple(_fault(spec) for spec in ns.inject),
            report=ns.report,
            hbm_bytes=None if ns.hbm is None else parse_size(ns.hbm),
            command=command or (),
            exec_mode=ExecMode(ns.exec_mode),
            program_clock=ProgramClock(ns.program_clock),
            nproc_per_node=ns.nproc_per_node,
            workdir=ns.workdir,
            clear_env=ns.clear_env_vars,
            debug_rank=ns.debug_rank,
            launcher=launcher,
            fork_server=ns.fork_server == "on",
        )
        validate(topology)
        check_combination(topology)
        if topology.launcher is Launcher.SLURM:
            from mirage_tui.hosts import netif  # (psutil: only when needed)

            netif.choose()  # an interface to listen on, or a one-line error naming NCCL_SOCKET_IFNAME
    except UsageError as e:
        raise UsageError(f"{e}; see '{help_prog} --help'") from None
    check_command(topology)
    return topology


def _run(topology: Topology) -> int:
    # Imported here: the runner pulls in the session machinery, which neither
    # --help nor a usage error should pay for.
    from mirage_tui.commands.batch import run_batch

    return run_batch(topology)


def _source(path: Path) -> str:
    """Where the profile file ``path`` comes from: ``built-in``, ``user`` (the user profile directory) or ``file``."""
    if path.parent == PROFILE_DIR:
        return "built-in"
    return "user" if path.parent == user_profile_dir() else "file"


def _profile_json(p: Profile, path: Path) -> dict[str, object]:
    """``p``'s fields as the TOML has them, plus where it comes from (``source``, ``file``)."""
    return profile_values(p) | {"source": _source(path), "file": str(path)}


def _print_profiles(as_json: bool) -> int:
    """``mirage profiles``: every profile, built-in and user, as a table or a JSON array."""
    profiles = [(load_profile(name), profile_path(name)) for name in profile_names()]
    if as_json:
        print(json.dumps([_profile_json(p, path) for p, path in profiles], indent=2))
        return 0
    rows = [("", "NAME", "PRODUCT", "GFX", "CUS", "HBM", "FP16 TFLOPS", "SOURCE")]
    for p, path in profiles:
        rows.append(
            (
                "*" if p.name == DEFAULT_PROFILE else "",
                p.name,
                p.product,
                p.gfx,
                str(p.compute_units),
                f"{p.hbm_gib:g} GiB {p.hbm_type}",
                f"{p.fp16_tflops:.1f}",
                f"user: {path}" if _source(path) == "user" else "built-in",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = {4, 6}  # right-aligned columns
    for row in rows:
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    print(f"* = default; user profiles live in {user_profile_dir()} ('mirage profiles create')")
    return 0


def _binary_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it readable, e.g. ``288 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def _show_profile(name: str, as_json: bool) -> int:
    """``mirage profiles show NAME``: every figure of one profile, aligned, or as a JSON object."""
    p, path = load_profile(name), profile_path(name)
    if as_json:
        print(json.dumps(_profile_json(p, path), indent=2))
        return 0
    print(f"{p.name}: {_source(path)} profile, {path}")
    values = profile_values(p)
    width = max(map(len, values))
    for field, value in values.items():
        # bytes are exact in the file; the binary size beside them is what a reader wants
        gloss = f"  ({_binary_size(value)})" if field.endswith("_bytes") and isinstance(value, int) else ""
        print(f"  {field.ljust(width)}  {value}{gloss}")
    return 0


def _create_profile(ns: argparse.Namespace) -> int:
    """``mirage profiles create NAME --from BASE``: write a user profile from BASE with overrides."""
    overrides: dict[str, object] = {}
    for item in ns.set:
        field, sep, text = item.partition("=")
        if not sep or not field:
            raise UsageError(f"--set expects FIELD=VALUE, e.g. --set compute_units=128, got {item!r}")
        overrides[field] = parse_field(field, text)
    if ns.hbm is not None:
        if "hbm_bytes" in overrides:
            raise UsageError("--hbm and --set hbm_bytes=... both set hbm_bytes; give one of them")
        overrides["hbm_bytes"] = parse_size(ns.hbm)
    path = create_user_profile(ns.name, ns.base, overrides, force=ns.force)
    print(f"wrote {path}; use it with 'mirage run --profile {ns.name}'")
    return 0


def _profiles(ns: argparse.Namespace) -> int:
    """The ``profiles`` commands; a bad profile file or name is a usage error, one line naming it."""
    try:
        if ns.profiles_cmd == "show":
            return _show_profile(ns.name, ns.json)
        if ns.profiles_cmd == "create":
            return _create_profile(ns)
        return _print_profiles(ns.json)
    except ProfileError as e:
        raise UsageError(str(e)) from None


def _dispatch(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    act: Callable[[argparse.Namespace, tuple[str, ...] | None], int],
) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and call ``act``; usage errors exit 2."""
    head, command = _split(sys.argv[1:] if argv is None else argv)
    try:
        try:
            ns = parser.parse_args(head)
        except SystemExit as e:  # only --help and --version exit; errors raise UsageError
            return int(e.code or 0)
        return act(ns, command)
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return COMMAND_NOT_FOUND_EXIT if isinstance(e, CommandNotFound) else USAGE_EXIT
    except BrokenPipeError:
        # the reader stopped early (``mirage profiles show X | head``): end quietly, as a tool killed by
        # SIGPIPE would, and keep the interpreter's final flush from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _print_status(run_dir: str | None, log_dir: str | None, fr_dump: bool) -> int:
    """``mirage status``: the collective ledger of a run, from its events.jsonl."""
    import os
    import time

    from mirage_tui.state.runstate import RunState

    # a call site may carry a lone surrogate (a script path that is not UTF-8): print it escaped, not crash
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    if run_dir is None:
        root = log_dir or os.path.join(".mirage", "runs")
        runs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))) if os.path.isdir(root) else []
        if not runs:
            raise UsageError(f"no runs under {root}; pass a run directory")
        run_dir = os.path.join(root, runs[-1])
    journal = os.path.join(run_dir, "events.jsonl")
    if not os.path.isfile(journal):
        raise UsageError(f"{run_dir} is not a mirage run directory (it has no events.jsonl)")
    state = RunState.from_journal(journal)
    if state.ended is None:
        print(f"run {run_dir}: live")
    else:
        print(f"run {run_dir}: ended with exit {state.ended.returncode}: {state.ended.summary}")
    # a live run's ages count to now; an ended run's to its last event
    print(state.ledger_table(now=None if state.ended else time.time()))
    print(state.memory_table())
    for h in state.hangs:
        print(f"hang: {h.waiting_for(state.comm_label(h.comm))}: missing ranks {set(h.missing)}")
    if fr_dump:
        from mirage_tui.reports import flight_recorder

        print(f"Flight Recorder dumps: {flight_recorder.dump_run(run_dir)}")
    return 0


def _mirage(ns: argparse.Namespace, command: tuple[str, ...] | None) -> int:
    if ns.cmd == "profiles":
        if command is not None:
            raise UsageError("'mirage profiles' takes no command after --")
        return _profiles(ns)
    if ns.cmd == "exec":
        from mirage_tui.commands import sessions as session_commands

        return session_commands.exec_in(ns.session, ns.node, command)
    if ns.cmd in ("sessions", "stop", "cleanup"):
        if command is not None:
            raise UsageError(f"'mirage {ns.cmd}' takes no command after --")
        from mirage_tui.commands import sessions as session_commands

        if ns.cmd == "sessions":
            return session_commands.list_sessions(ns.json, ns.all)
        if ns.cmd == "cleanup":
            return session_commands.clean_up(ns.dry_run)
        return session_commands.stop_session(ns.session, ns.timeout)
    if ns.cmd == "status":
        if command is not None:
            raise UsageError("'mirage status' takes no command after --")
        return _print_status(ns.run_dir, ns.log_dir, ns.fr_dump)
    return _run(_topology(ns, command, "mirage run"))


def _demo_command(gpus: int, mirage_starts_ranks: bool = False) -> tuple[str, ...]:
    """The bundled demo: a DDP MLP trained with torchrun on ``gpus`` emulated GPUs (or, with
    ``--nproc-per-node``, run directly: mirage starts its ranks)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if mirage_starts_ranks:
        return (sys.executable, os.path.join(root, "tests", "fixtures", "ml", "ddp_mlp.py"))
    # the torchrun next to this interpreter, so a venv that was not activated still works
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return (torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", f"--nproc_per_node={gpus}",
            os.path.join(root, "tests", "fixtures", "ml", "ddp_mlp.py"))


#: mirage-tui's own flags: they choose how the console runs, not the run's topology.
_CONSOLE_FLAGS = ("batch", "start", "replay", "attach", "serve", "speed", "theme")


def _mirage_tui(ns: argparse.Namespace, command: tuple[str, ...] | None) -> int:
    if ns.batch:
        for flag in ("replay", "attach", "serve", "speed", "theme"):
            if getattr(ns, flag) is not None:
                raise UsageError(f"--{flag} is for the console; drop it or drop --batch")
        return _run(_topology(ns, command, "mirage-tui"))
    if ns.speed is not None and not ns.speed > 0:
        raise UsageError(f"--speed must be a number above 0 (2 plays twice as fast), got {ns.speed:g}")
    # Imported here: batch mode, --help and usage errors must never import textual.
    from mirage_tui.app import themes

    theme = themes.DEFAULT_THEME if ns.theme is None else themes.resolve(ns.theme)
    if theme is None:
        names = ", ".join(themes.theme_files())
        raise UsageError(f"--theme must be one of {names}, got {ns.theme!r}")
    if ns.attach is not None:
        return _attach(ns, command, theme)
    if ns.serve is not None:
        raise UsageError("--serve serves an attached console: use it with --attach [SESSION|RUN_DIR]")
    if ns.replay is not None:
        return _replay(ns, command, theme)
    if ns.speed is not None:
        raise UsageError("--speed sets the pace of --replay RUN_DIR; it does nothing for a live run")
    return _console(ns, command, theme)


def _attach(ns: argparse.Namespace, command: tuple[str, ...] | None, theme: str) -> int:
    """``mirage-tui --attach [SESSION|RUN_DIR]``: the console on a live session another process owns."""
    import os

    from mirage_tui.session import registry as sessions

    if command is not None:
        raise UsageError("--attach follows a live session; it takes no command after --")
    for flag in ("replay", "speed"):
        if getattr(ns, flag) is not None:
            raise UsageError(f"--{flag} is for recorded runs; drop it or drop --attach")
    running = sessions.live()
    if not ns.attach and len(running) > 1 and ns.serve is None:  # several, none named: the console offers them
        from mirage_tui.app.app import MirageApp

        app = MirageApp(pick=running, theme=theme)
        app.run()
        return 1 if app.return_code is None else app.return_code
    entry = sessions.find(ns.attach or None)
    if os.stat(entry.run_dir).st_uid != os.getuid() or not os.access(entry.run_dir, os.R_OK | os.X_OK):
        raise UsageError(f"session {entry.session} is another user's: only its owner may attach")
    if ns.serve is not None:
        from mirage_tui.app.serve import serve

        return serve(entry, ns.serve, theme)
    from mirage_tui.app.app import MirageApp

    app = MirageApp(attach=entry, theme=theme)
    app.run()
    return 1 if app.return_code is None else app.return_code


def _replay(ns: argparse.Namespace, command: tuple[str, ...] | None, theme: str) -> int:
    """``mirage-tui --replay RUN_DIR``: play a recorded run in the console."""
    from mirage_tui.state.replay import ReplayError, load

    if command is not None:
        raise UsageError("--replay plays a recorded run; it takes no command after --")
    try:
        recording = load(ns.replay)
    except ReplayError as e:
        raise UsageError(f"--replay: {e}; pass a run directory such as .mirage/runs/<run>") from None
    from mirage_tui.app.app import MirageApp

    app = MirageApp(recording=recording, speed=ns.speed or 1.0, theme=theme)
    app.run()
    return 1 if app.return_code is None else app.return_code


def _console(ns: argparse.Namespace, command: tuple[str, ...] | None, theme: str) -> int:
    """The Setup form prefilled from the flags (or, with none at all, the last run), then the run."""
    import os

    from mirage_tui.app.app import MirageApp
    from mirage_tui.config import topology_file

    # no flag at all: the form starts from the last run the console started, if any
    untouched = command is None and all(
        value == _tui_parser().get_default(key) for key, value in vars(ns).items() if key not in _CONSOLE_FLAGS
    )
    if not command:
        # no program: the demo cluster training; 2 GPUs unless the user changed the default
        if ns.gpus_per_node is None:
            ns.gpus_per_node = 2
        command = _demo_command(ns.gpus_per_node, ns.nproc_per_node is not None)
    topology = demo = _topology(ns, command, "mirage-tui")
    if untouched and os.path.isfile(topology_file.LAST_PATH):
        try:
            topology = topology_file.load(topology_file.LAST_PATH, base=demo)
        except UsageError as e:  # a damaged last-run file must not lock the console; the demo stands in
            print(f"mirage-tui: ignoring {topology_file.LAST_PATH}: {e}", file=sys.stderr)
    if ns.start:
        try:
            validate(topology)
        except UsageError as e:
            raise UsageError(f"{topology_file.LAST_PATH}: {e}") from None
    app = MirageApp(topology, setup=not ns.start, demo=demo, theme=theme)
    try:
        app.run()
    finally:
        app.stop_session()  # however the app ended, the run's processes end with it
    if app.outcome is not None:
        print(f"mirage-tui: exit {app.outcome.returncode}: {app.outcome.summary}; run dir: {app.outcome.run_dir}",
              file=sys.stderr)
    return 1 if app.return_code is None else app.return_code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mirage`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _Parser(
        prog="mirage", description="Run multi-GPU PyTorch programs on emulated AMD GPUs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run a program on an emulated cluster",
        usage="%(prog)s [options] -- COMMAND [ARGS...]",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_flags(run)
    _add_profiles_parser(sub)
    status = sub.add_parser("status", help="where every rank is in every communicator, live or after the run")
    status.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory (default: the latest run)")
    status.add_argument("--log-dir", metavar="DIR", help="where runs are kept (default: .mirage/runs)")
    status.add_argument(
        "--fr-dump", action="store_true",
        help="also write Flight Recorder dumps (for torch's fr_trace) into RUN_DIR/flight-recorder",
    )
    listing = sub.add_parser("sessions", help="the live sessions on this machine (runs you can attach to or stop)")
    listing.add_argument("--json", action="store_true", help="a JSON array, for scripts")
    listing.add_argument("--all", action="store_true", help="also sessions whose owner was killed (dead)")
    run_in = sub.add_parser("exec", help="run a command in a live session's environment on one of its nodes",
                            usage="%(prog)s SESSION [--node N] -- COMMAND [ARGS...]")
    run_in.add_argument("session", metavar="SESSION", help="its id (or a unique prefix) or its run directory")
    run_in.add_argument("--node", type=int, default=0, metavar="N", help="the emulated node (default: 0)")
    clean = sub.add_parser("cleanup", help="remove what killed sessions left: processes, shared memory, sockets")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    stop = sub.add_parser("stop", help="end a live session as Ctrl-C in its terminal would")
    stop.add_argument("session", metavar="SESSION", help="its id (or a unique prefix) or its run directory")
    stop.add_argument("--timeout", type=float, default=60.0, metavar="S",
                      help="how long to wait for it to end (default: 60)")
    return _dispatch(parser, argv, _mirage)


def _add_profiles_parser(sub: Any) -> None:
    """``mirage profiles [--json]``, ``profiles show NAME [--json]``, ``profiles create NAME --from BASE ...``."""
    profiles = sub.add_parser("profiles", help="list the GPU models mirage can emulate (show one, create your own)")
    profiles.add_argument("--json", action="store_true", help="a JSON array of every profile, for scripts")
    commands = profiles.add_subparsers(dest="profiles_cmd", metavar="COMMAND")
    show = commands.add_parser("show", help="every figure of one profile")
    show.add_argument("name", metavar="NAME", help="a built-in or user profile")
    # SUPPRESS: 'profiles --json show NAME' must keep the --json given before 'show'
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="a JSON object, for scripts")
    create = commands.add_parser(
        "create",
        help="write a user profile: a built-in's figures with some changed",
        description=f"Write {user_profile_dir()}/NAME.toml from BASE's figures with the changes given.",
    )
    create.add_argument("name", metavar="NAME", help="the new profile's name: lower-case letters, digits, - and _")
    create.add_argument("--from", dest="base", required=True, metavar="BASE", help="the profile to start from, e.g. mi350x")
    create.add_argument("--hbm", metavar="SIZE", help="memory of each GPU, e.g. 96GiB (sets hbm_bytes)")
    create.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="any other field, as 'mirage profiles show' names it, e.g. compute_units=128 (repeatable)",
    )
    create.add_argument("--force", action="store_true", help="overwrite the user profile NAME if it exists")


def _tui_parser() -> _Parser:
    parser = _Parser(
        prog="mirage-tui",
        usage="%(prog)s [options] [--batch | --start | --replay RUN_DIR] [-- COMMAND [ARGS...]]",
        description="Watch a multi-GPU PyTorch program run on emulated AMD GPUs.",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_run_flags(parser)
    parser.add_argument(
        "--batch", action="store_true", help="no console: stream output like 'mirage run'"
    )
    parser.add_argument("--start", action="store_true", help="launch at once, without the Setup form")
    parser.add_argument("--replay", metavar="RUN_DIR", help="play a recorded run (its events.jsonl) in the console")
    parser.add_argument(
        "--attach", nargs="?", const="", metavar="SESSION|RUN_DIR",
        help="the console on a live session started elsewhere ('mirage sessions'; none named: the only one); "
             "quitting detaches",
    )
    parser.add_argument("--serve", metavar="[HOST:]PORT",
                        help="with --attach: serve that console to a browser (loopback unless HOST is named)")
    parser.add_argument("--speed", type=float, metavar="X", help="replay pace, a multiple of the recorded one (default: 1)")
    parser.add_argument("--theme", metavar="NAME", help="dark (default), light or high-contrast")
    return parser


def tui_main(argv: Sequence[str] | None = None) -> int:
    """Run ``mirage-tui`` with ``argv``; ``--batch`` makes it behave like ``mirage run``."""
    return _dispatch(_tui_parser(), argv, _mirage_tui)


if __name__ == "__main__":
    sys.exit(main())
