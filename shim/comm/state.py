"""torch.distributed's per-rank state, kept by the rank's runtime (``RUNTIME.comm``).

Built when this module loads, and again if the runtime is rebuilt for another
rank (``shim.rank.runtime.Runtime.rebuild``): the worlds this process formed,
the group being created, and the faults ``mirage run --inject`` planned.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

from shim.rank.runtime import RUNTIME
from wire import faults


@dataclass
class GroupBirth:
    """The group ``_new_process_group_helper`` is creating: what the backend's constructor is not told."""

    ranks: list[int] = field(default_factory=list)  # global ranks: NCCL's globalRankStart / globalRankStride
    name: str = ""  # torch's group_name ("0", "1", or a hash of the ranks)
    desc: str = ""  # torch's group_desc ("default_pg", "mesh_tp", the user's, "undefined")

    def begin(self, ranks: list[int], name: str, desc: str) -> None:
        """A group of these global ranks, names and description is being created."""
        self.ranks, self.name, self.desc = ranks, name, desc

    def end(self) -> None:
        """The group exists (or failed to): nothing is being created."""
        self.begin([], "", "")


class CommState:
    """What the rank's process groups keep between calls (see the module docstring)."""

    def __init__(self, inject: str) -> None:
        #: how many worlds this process formed under each rendezvous address: the ranks of one world
        #: agree on the count, and a world formed again (after destroy_process_group) is a new one
        self.formed: dict[str, itertools.count] = {}
        #: set around _new_process_group_helper (shim.comm.c10d_patches), cleared after it
        self.creating = GroupBirth()
        #: the run's fault plan (wire.faults); this rank's share once taken (shim.comm.fault_injection)
        self.planned = faults.parse_env(inject)
        self.faults: list[faults.Fault] = []
        self.faults_chosen = False
        #: the Work each DDP reducer was last handed by Join (shim.comm.c10d_patches), dropped with the reducer
        self.join_work: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _build(runtime) -> None:
    runtime.comm = CommState(runtime.settings.inject)


RUNTIME.attach(_build)
