"""The forked rank's side: become the process the stub was, then run its program as ``python`` would.

:func:`become` takes over the stub's open files (at the same numbers), signal
dispositions, environment, working directory, umask, ``sys.argv``/``sys.path``
and standard streams, and gives the modules the server imported what a fresh
process would have (its own random seeds, its thread count).
:func:`run` then does what ``sitecustomize`` does in a session's process
(``shim.bootstrap.boot``) and runs the script, ``-m`` module or ``-c``
command in a new ``__main__``, ending as the interpreter would: an uncaught
exception's traceback (from the program's own frames) and exit status 1, or
``SystemExit``'s code, after the exit hooks (:func:`_exit` says what it skips).
"""

from __future__ import annotations

import builtins
import ctypes
import fcntl
import gc
import importlib
import io
import os
import signal
import sys
import types

from forkserver.handover import FORWARDED
from forkserver.protocol import Handover, Stdio

_PR_SET_PDEATHSIG = 1


def _mode(h: Handover) -> tuple[str, str]:
    """("script", path), ("module", name) or ("command", code): what the stub's command line runs."""
    first = h.argv[0]
    if first not in ("-c", "-m"):
        return "script", first
    # sys.argv keeps what follows the command or module name; the element before those is it,
    # alone ("-c", CODE) or joined to its option ("-cCODE", "-uc" CODE)
    at = len(h.orig_argv) - len(h.argv)
    value, before = h.orig_argv[at], h.orig_argv[at - 1]
    letter = first[1]
    if not (before.startswith("-") and not before.startswith("--") and before.endswith(letter)):
        value = value[value.index(letter, 1) + 1:]
    return ("command" if letter == "c" else "module"), value


def sys_path0(h: Handover) -> str | None:
    """What the interpreter puts first on sys.path for this command line (None with ``-P``)."""
    if h.flags.get("safe_path"):
        return None
    kind, value = _mode(h)
    if kind == "script":
        return os.path.dirname(os.path.realpath(os.path.join(h.cwd, value)))
    return h.cwd if kind == "module" else ""


def become(h: Handover, fds: list[int], server: int, stub: int) -> None:
    """Turn this freshly forked child of the server into the process ``h`` describes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the server's end (the session's) is this rank's
    if os.getppid() != server:
        os._exit(1)
    _take_fds(fds, h.fds, h.inheritable)
    _signals(h.ignored_signals)
    os.chdir(h.cwd)
    os.umask(h.umask)
    os.environ.clear()
    os.environ.update(h.env)
    os.environ["MIRAGE_FORKED_AS"] = f"{os.getpid()}:{stub}"  # the shim names the stub as what was launched
    os.getppid = _parent_through(stub)
    sys.argv, sys.orig_argv = list(h.argv), list(h.orig_argv)
    sys.path[:] = h.path
    _stdio(h.stdio, set(h.fds))
    _fresh_modules(h.env)


def _parent_through(stub: int):
    """``os.getppid`` for a forked rank: its stub's parent (the launcher), which is who a fresh process's
    parent would be; inductor's compile workers, given the rank's pid, exit when getppid() differs."""
    real = os.getppid

    def getppid() -> int:
        try:
            with open(f"/proc/{stub}/stat", "rb") as f:
                return int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # the stub is gone: the rank ends with it
            return real()

    return getppid


def _take_fds(received: list[int], targets: list[int], inheritable: list[bool]) -> None:
    """Put the stub's descriptors at their numbers and close every other one the server had open."""
    base = max([*received, *targets, 2]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in received]
    keep = set(moved)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for tmp, fd, inh in zip(moved, targets, inheritable):
        os.dup2(tmp, fd, inheritable=inh)
        os.close(tmp)


def _signals(ignored: list[int]) -> None:
    """Dispositions as a fresh interpreter has them under the stub's parent."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, *FORWARDED):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)


def _stdio(stdio: list[Stdio], open_fds: set[int]) -> None:
    """New standard streams over the stub's descriptors 0-2, buffered as its interpreter buffered them."""
    streams = []
    for fd, s in enumerate(stdio):
        if fd not in open_fds:
            streams.append(None)
            continue
        write = fd > 0
        raw_only = write and s.write_through
        buf = io.open(fd, "wb" if write else "rb", buffering=0 if raw_only else -1, closefd=False)
        streams.append(io.TextIOWrapper(buf, encoding=s.encoding, errors=s.errors, newline=None if fd == 0 else "\n",
                                        line_buffering=s.line_buffering, write_through=s.write_through))
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def _fresh_modules(env: dict[str, str]) -> None:
    """What the preloaded modules would have set up differently in a fresh process of this rank."""
    importlib.invalidate_caches()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:  # each process's own entropy, as at numpy's import (random reseeds itself)
        np_random.seed()
    runtime = sys.modules.get("shim.rank.runtime")
    if runtime is not None:  # the server preloaded the shim: this rank's settings, not the server's
        from shim.rank.settings import Settings

        runtime.RUNTIME.rebuild(Settings.from_environ())  # (MIRAGE_FORKED_AS included)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # torchrun sets it per worker; libgomp read the server's


def _exec_main(kind: str, value: str) -> None:
    main = types.ModuleType("__main__")  # with what the interpreter's add_main_module gives it
    main.__dict__.update(__builtins__=builtins, __annotations__={}, __loader__=importlib.machinery.BuiltinImporter)
    sys.modules["__main__"] = main
    if kind == "module":
        import runpy

        runpy._run_module_as_main(value)  # what 'python -m' calls; it sets sys.argv[0]
        return
    if kind == "command":
        code = compile(value, "<string>", "exec")
    else:
        path = os.path.abspath(value)
        main.__file__, main.__cached__ = path, None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        with open(value, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def run(h: Handover) -> None:
    """Boot the shim as sitecustomize would in a session, run the program, and end as the interpreter would."""
    kind, value = _mode(h)
    first = sys_path0(h)
    if first is not None:
        sys.path.insert(0, first)
    if os.environ.get("MIRAGE_SESSION"):  # what sitecustomize does in a session's process
        from forkserver.preload import LOADED
        from shim import bootstrap, import_hooks
        from shim.rank.runtime import RUNTIME

        import_hooks.wait_for_program(LOADED)
        # the shim's layers were built at the fork (forkserver.program._fresh_modules) from the environment
        # the rank started with; a fresh process builds them when torch's import activates the shim, after
        # the program's first lines (which may set CUDA_VISIBLE_DEVICES): so they are built again then
        import_hooks.after_import("torch", RUNTIME.build_again)
        bootstrap.boot()
    try:
        _exec_main(kind, value)
    except SystemExit as e:
        _exit(_exit_code(e.code))
    except BaseException as e:  # what the interpreter does with it, less the server's frames
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code is not _exec_main.__code__:
            tb = tb.tb_next
        tb = tb.tb_next if tb is not None else e.__traceback__
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        _exit(1, by_sigint=isinstance(e, KeyboardInterrupt))
    _exit(0)


def _exit_code(code) -> int:
    """SystemExit's code as the interpreter turns it into a status (anything else printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except (OSError, ValueError, AttributeError):
        pass
    return 1


def _files_of_this_process() -> list:
    """The open, writable files among the objects this process made (the collector's generations; the
    server's objects are frozen apart, and looking through them would copy them)."""
    files = []
    for generation in range(3):
        for obj in gc.get_objects(generation):
            if not issubclass(type(obj), io.IOBase):  # type(): isinstance would ask a dead weakref proxy
                continue
            try:
                if not obj.closed and obj.writable():
                    files.append(obj)
            except Exception:  # a file half torn down answers oddly: it is not ours to flush then
                pass
    return files


def _exit(code: int, by_sigint: bool = False) -> None:
    """End as the interpreter's finalization begins (wait for threads, exit hooks, flush the standard
    streams), then leave without tearing down every module, as multiprocessing's forked children do.

    The teardown would drop a reference to every object the server imported and so copy the whole shared
    heap into this process (and spend half a second of CPU) just before it ends. What it would have done
    that a program could notice: flush the files the program left open (done here); run ``__del__`` of
    objects still alive, which CPython does not promise at exit. An uncaught KeyboardInterrupt ends the
    process by SIGINT, as CPython does.
    """
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for f in [*_files_of_this_process(), sys.stdout, sys.stderr]:
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if by_sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
