"""ProcessGroupNCCL's error wording, which users grep their logs for.

Every failure of an emulated collective reaches the program as the exception
and the ``NCCL WARN`` line a GPU build would give (docs/debugging.md lists
them): a daemon ``Error`` reply through :func:`nccl_error`, a collective that
waited past its group's timeout through :func:`watchdog_timeout`.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from types import MappingProxyType

import torch.distributed as dist

from shim.cuda.api import NCCL_VERSION
from wire import schema as s

_NCCL_TEXT = MappingProxyType({
    "ncclInvalidUsage": ("invalid usage", "This usually reflects invalid usage of NCCL library."),
    "ncclInvalidArgument": ("invalid argument", "Invalid value for an argument."),
    "ncclSystemError": ("unhandled system error", "System call (e.g. socket, malloc) or external library call failed."),
    "ncclRemoteError": ("remote process exited or there was a network error", "A call failed possibly due to a network error or a remote process exiting prematurely."),
})


def nccl_error(code: str, message: str, device: int) -> dist.DistBackendError:
    """An exception worded as ProcessGroupNCCL words it, after NCCL's ``WARN`` line on stderr."""
    short, explain = _NCCL_TEXT.get(code, ("internal error", "Internal check failed."))
    print(
        f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} [{device}] "
        f"NCCL WARN {message}",
        file=sys.stderr,
        flush=True,
    )
    return dist.DistBackendError(
        f"NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2210, {short} "
        f"(run with NCCL_DEBUG=WARN for details), NCCL version {'.'.join(map(str, NCCL_VERSION))}\n"
        f"{code}: {explain}\nLast error:\n{message}"
    )


def watchdog_timeout(rank: int, timeout_s: float, req: s.Collective, waited_s: float) -> dist.DistBackendError:
    """ProcessGroupNCCL's watchdog message for collective ``req`` of group rank ``rank``, printed and returned."""
    text = (
        f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={req.seq}, "
        f"OpType={req.op.name}, NumelIn={req.numel}, NumelOut={req.out_numel}, Timeout(ms)={int(timeout_s * 1000)}) "
        f"ran for {int(waited_s * 1000)} milliseconds before timing out."
    )
    print(text, file=sys.stderr, flush=True)
    return dist.DistBackendError(text)
