"""The stub's side: hand this process over to the fork server, forward signals, exit with the rank's status.

:func:`hand_over` runs first thing in ``sitecustomize``. If the session has a
fork server and this process may be served, it never returns: the forked
rank runs the program, and this process stays what the launcher started
(the pid torchrun's agent, ``mp.spawn`` or Slurm watch and signal), passing
every signal on and ending as the rank ended. Otherwise it returns, having
printed one line saying why when the server refused, and the process starts
as a fresh interpreter.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from forkserver.protocol import ENV, MAX_FDS, SERVER_ENV, Handover, Stdio, send_handover

#: what a launcher or a user sends a rank; everything else keeps its disposition (SIGKILL cannot be caught)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGWINCH, signal.SIGCONT, signal.SIGTSTP)
_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _served_here(argv: list[str]) -> bool:
    """Whether this interpreter runs a program the server can take over: a script, ``-m`` or ``-c``
    (not an interactive prompt, nor torchrun's agent, which starts the ranks and stays itself)."""
    # the test shim.bootstrap.is_torchrun_agent makes, which this module (standard library only) cannot import
    args = argv[1:]
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
        return False
    if any(a == "-m" and b in _AGENT_MODULES for a, b in zip(args, args[1:])):
        return False
    if sys.flags.inspect or sys.flags.interactive:
        return False
    return len(sys.argv) > 0 and sys.argv[0] not in ("", "-")


def _open_fds(skip: int) -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)  # the listing's own descriptor is gone by now
        except OSError:
            continue
        fds.append(fd)
    return sorted(fds)


def _stdio() -> list[Stdio]:
    return [Stdio(s.encoding, s.errors, s.line_buffering, s.write_through) if s is not None else
            Stdio("utf-8", "strict", False, False) for s in (sys.stdin, sys.stdout, sys.stderr)]


def _handover(fds: list[int]) -> Handover:
    flags = {name: getattr(sys.flags, name) for name in dir(sys.flags)
             if not name.startswith("_") and isinstance(getattr(sys.flags, name), int)}
    ignored = [int(s) for s in signal.valid_signals()
               if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is signal.SIG_IGN
               and s not in (signal.SIGPIPE, signal.SIGXFSZ)]  # Python ignores these two itself
    umask = os.umask(0)
    os.umask(umask)
    return Handover(
        orig_argv=list(sys.orig_argv), argv=list(sys.argv), executable=sys.executable, prefix=sys.prefix,
        version=sys.version, flags=flags, xoptions=dict(sys._xoptions), warnoptions=list(sys.warnoptions),
        path=list(sys.path), cwd=os.getcwd(), umask=umask, env=dict(os.environ), fds=fds,
        inheritable=[os.get_inheritable(fd) for fd in fds], ignored_signals=ignored, stdio=_stdio())


def hand_over() -> None:
    """Become a stub for a rank forked by the session's fork server, if there is one and it serves us;
    return (this process then runs the program itself) otherwise."""
    path = os.environ.get(ENV)
    if not path or os.environ.get(SERVER_ENV) or not _served_here(sys.orig_argv):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return  # the session ended or never started one: start as usual, there is nothing to say
    fds = _open_fds(sock.fileno())
    if len(fds) > MAX_FDS:
        sock.close()
        print(f"mirage: this process has {len(fds)} open files, more than the fork server takes ({MAX_FDS}); "
              f"starting it as a new interpreter", file=sys.stderr)
        return
    send_handover(sock, _handover(fds), fds)
    _wait(sock)


def _wait(sock: socket.socket) -> None:
    """Pass signals on to the rank until the server says how it ended; end the same way."""
    reader = sock.makefile("r", encoding="utf-8")
    first = reader.readline().split(" ", 1)
    if first[0] in ("refuse", ""):  # "": it ended before forking (a rank it forks dies with it)
        sock.close()
        why = first[1].strip() if first[0] else "it ended before answering"
        print(f"mirage: the fork server cannot start this process ({why}); starting it as a new interpreter",
              file=sys.stderr)
        return
    if first[0] != "pid":
        os._exit(_lost())
    child = int(first[1])

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    try:
        for sig in FORWARDED:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, forward)
        how = reader.readline().split()
        _end_as(how)
    except BaseException:  # never return: the program ran in the rank, it must not run here again
        os._exit(_lost())


def _end_as(how: list[str]) -> None:
    """Exit as the rank did: ``["exit", code]`` or ``["signal", number]`` (by that signal, if it is fatal)."""
    if len(how) != 2 or how[0] not in ("exit", "signal"):
        os._exit(_lost())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    code = int(how[1])
    if how[0] == "signal":
        if code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [code])
        os.kill(os.getpid(), code)
        code += 128  # a signal whose default is not to end the process (never seen from a rank that ended)
    os._exit(code)


def _lost() -> int:
    print("mirage: the fork server ended while this rank ran; the rank ended with it", file=sys.stderr)
    return 1
