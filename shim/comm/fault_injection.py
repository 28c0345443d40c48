"""``mirage run --inject``: the faults planned for this rank's collectives, acted out when their turn comes.

The plan (``wire/faults.py``) travels in the environment for the whole
run; this process takes its rank's share when its default group is created
(not by $RANK: mp.spawn children all inherit their parent's) and counts that
group's sequence numbers.
"""

from __future__ import annotations

import os
import sys
import time

from shim.comm import state as _state  # noqa: F401 - it builds RUNTIME.comm, which holds the plan
from shim.rank.runtime import RUNTIME
from wire import faults


def choose(rank: int) -> None:
    """Take the planned faults of default-group rank ``rank``; once: a fault acted out stays done after a re-init."""
    comm = RUNTIME.comm
    if not comm.faults_chosen:
        comm.faults_chosen = True
        comm.faults.extend(f for f in comm.planned if f.rank == rank)


def pending() -> bool:
    """Whether any fault is still to be acted out (a cheap test on every collective)."""
    return bool(RUNTIME.comm.faults)


def inject(seq: int) -> bool:
    """Act out a fault planned for collective ``seq``; True when the collective is to be skipped."""
    planned = RUNTIME.comm.faults
    for f in list(planned):
        if f.seq != seq:
            continue
        planned.remove(f)  # once: a skipped collective's number comes round again
        print(f"mirage: injecting {f.action.value} at collective #{seq} of rank {f.rank}", file=sys.stderr, flush=True)
        if f.action is faults.Action.DELAY:
            time.sleep(f.delay_s)
        elif f.action is faults.Action.HANG:
            while True:
                time.sleep(3600)
        elif f.action is faults.Action.CRASH:
            os.abort()
        else:
            return True
    return False
