"""``torchrun --standalone --nproc_per_node=N SCRIPT ARGS`` for the tests' CPU + gloo references, forked.

    python tests/fork_ranks.py N SCRIPT [ARGS...]

Imports torch once, then forks N ranks, each given torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 for several ranks, unless set)
and running SCRIPT as ``__main__`` with SCRIPT's folder first on sys.path. torchrun starts a fresh
interpreter per rank, each importing torch again: two to three seconds of CPU a rank, most of what a
small reference run costs on a 2-core box. Exits with the first failing rank's status, after killing
the others (a peer left in a collective would wait for it until gloo's half-hour timeout); ranks die
with this process.
"""

import ctypes
import os
import runpy
import signal
import socket
import sys
import traceback


def _rank(rank: int, nprocs: int, port: int, script: str, args: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: not outlive the launcher
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter reports it
        return 1
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception is, with the status 1
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    nprocs, script, args = int(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]
    if nprocs > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks on a node
    import torch  # noqa: F401 - once, before forking: every rank starts with it imported
    import torch.distributed  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:
            code = _rank(rank, nprocs, port, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        ranks.append(pid)
    status = 0
    while ranks:
        pid, wait_status = os.wait()
        ranks.remove(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code and not status:
            status = code if code > 0 else 128 - code  # killed by a signal: as a shell reports it
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    sys.exit(status)


if __name__ == "__main__":
    main()
