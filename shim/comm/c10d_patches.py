"""The ``"nccl"`` backend's place in torch.distributed: registration, and the c10d and DDP patches.

:func:`install` registers :class:`~shim.comm.process_group.MirageProcessGroup` as
torch's backend for ``"nccl"`` (and for ``"cpu:gloo,cuda:nccl"``, with gloo for
CPU tensors), keeping the name ``"nccl"`` visible to ``dist.get_backend()``;
and patches what c10d or DDP would do differently with a Python process group
than with ProcessGroupNCCL: ``split_group``, ``destroy_process_group``
(``ncclCommFinalize``'s draining), ``_set_pg_timeout``, DDP's allocations on
its module's GPU.
"""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from shim.comm.process_group import MirageProcessGroup
from shim.device import state as dev
from shim.memory import pinned
from shim.rank.runtime import RUNTIME
from shim.tensor.wrapper import MirageTensor
from shim.transport import profiler as prof
from shim.transport import stream

NAME = "mirage"
NAME_WITH_GLOO = "mirage_gloo"


def _create(store, rank, size, timeout):
    return MirageProcessGroup(store, rank, size, timeout)


def _create_with_gloo(store, rank, size, timeout):
    return MirageProcessGroup(store, rank, size, timeout, cpu=dist.ProcessGroupGloo(
        dist.PrefixStore("cpu/", store), rank, size, timeout=timeout))


def _to_mirage(backend) -> str | None:
    """Our backend for a requested one: cuda-only, or with gloo for CPU tensors (mixed or unspecified)."""
    text = "undefined" if backend is None else str(backend)
    if text == "undefined" or ("nccl" in text and "cpu:" in text):
        return NAME_WITH_GLOO
    return NAME if "nccl" in text else backend


def _split_group(split_group):
    """``dist.split_group`` for our groups: each split becomes a group of its members.

    torch splits through the C++ backend (``ncclCommSplit``); ours is a Python
    group, so the split is made as ``new_group`` over the member ranks, which
    only those members enter, as only they enter ``ncclCommSplit``'s child.
    """

    @functools.wraps(split_group)
    def split(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
        parent = parent_pg or c10d._get_default_group()
        if dist.get_backend(parent) != "nccl":  # a CPU build has no other nccl than ours
            return split_group(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
        if not split_ranks:
            raise ValueError("split_ranks cannot be None or empty")
        me = parent.rank()
        to_global = dist.get_process_group_ranks(parent)
        mine = None
        for ranks in split_ranks:
            if not ranks:
                raise ValueError("the split group cannot be empty")
            if len(ranks) > dist.get_world_size():
                raise ValueError("the split group's size should be less or equal to the world_size set by "
                                 "init_process_group")
            if len(ranks) != len(set(ranks)):
                raise ValueError("the split group cannot have duplicate ranks")
            if me in ranks:
                mine = sorted(ranks)
        if mine is None:
            return None
        return dist.new_group([to_global[r] for r in mine], timeout=timeout, backend=backend, pg_options=pg_options,
                              use_local_synchronization=True, group_desc=group_desc)

    return split


UNUSED_PARAMETERS_MESSAGE = (
    "mirage: DistributedDataParallel({arg}=True) needs mirage's pinned host allocator, which this "
    "machine lacks: {why}. DDP's reducer exchanges its map of used parameters through pinned host "
    "memory. Install a C++ compiler (or set CXX) and run again, or make every parameter take part "
    "in the loss and drop {arg}. See docs/compatibility.md."
)


def _refuse_unused_parameters(init):
    """``DistributedDataParallel.__init__`` refusing, by name, what would abort at the first backward.

    Only without the native pinned allocator (``shim/memory/pinned.py``), which the reducer needs for these.
    """

    @functools.wraps(init)
    def checked(self, module, *args, **kwargs):
        for arg in ("find_unused_parameters", "static_graph"):
            if kwargs.get(arg) and any(isinstance(p, MirageTensor) for p in module.parameters()):
                raise NotImplementedError(UNUSED_PARAMETERS_MESSAGE.format(arg=arg, why=pinned.NATIVE_ERROR))
        return init(self, module, *args, **kwargs)

    return checked


def _on_module_gpu(method):
    """A ``DistributedDataParallel`` method run with C++ allocations on its module's emulated GPU.

    DDP's C++ (its parameter check, the reducer's buckets, built at construction or unpickling and
    rebuilt in ``forward``) allocates on its parameters' device, which C++ sees as the backend's one device
    for every emulated GPU: without this it landed on the *current* GPU, so a program that moves
    its model to ``cuda:1`` without ``set_device(1)`` (as PyTorch's own DDP tests do) had rank 1's
    buckets on GPU 0 and NCCL's "Duplicate GPU detected".
    """

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        # forward: self.module; __init__(module, ...); __setstate__(state): the pickled module
        state = args[0] if args and isinstance(args[0], dict) else {}
        modules = self.__dict__.get("_modules") or state.get("_modules") or {}
        module = modules.get("module") or (args[0] if args else kwargs.get("module"))
        first = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
        if not isinstance(first, MirageTensor):
            return method(self, *args, **kwargs)
        with dev.allocating_on(first._gpu):
            return method(self, *args, **kwargs)

    return run




def _keeping_join_work(set_handle):
    """``Reducer._set_forward_pass_work_handle`` keeping the Python object of the Work it is handed alive.

    Under ``Join``, DDP's forward hands the reducer its join all-reduce's Work,
    which here is a Python ``dist.Work`` (``comm_stream.CollectiveWork``); the reducer
    keeps only the C++ half and, with ``divide_by_initial_world_size=False``,
    waits on it in backward. Once Python has dropped the object, that C++ half
    no longer finds our ``wait``/``get_future`` and falls back to c10d's base
    ``Work::wait``, which nothing ever completes: backward hung at the first
    step. NCCL's Work is C++ through and through; ours lives as long as the
    reducer holds it (until the next forward replaces it, or the reducer dies).
    """

    @functools.wraps(set_handle)
    def set_forward_pass_work_handle(reducer, work, *args, **kwargs):
        RUNTIME.comm.join_work[reducer] = work
        return set_handle(reducer, work, *args, **kwargs)

    return set_forward_pass_work_handle


def _finalizing(destroy):
    """``destroy_process_group`` completing the group's posted collectives first (all of them for the
    world), as ``ncclCommFinalize`` does: nothing the daemon may still read is let go under it."""

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            stream.drain()
        elif group is not dist.GroupMember.NON_GROUP_MEMBER:
            stream.drain(group.group_name)
        return destroy(group)

    return destroy_process_group


def _set_pg_timeout(set_timeout):
    """``_set_pg_timeout`` (torchtitan calls it after its first step) for our groups, which are their own backend.

    torch's looks for a ``ProcessGroupNCCL`` behind the group, which a CPU
    build does not have; the watchdog's deadline here is the group's timeout.
    """

    @functools.wraps(set_timeout)
    def setter(timeout, group=None):
        pg = c10d._get_default_group() if group is None else group
        if not isinstance(pg, MirageProcessGroup):  # another backend's (a device mesh's gloo or fake group)
            return set_timeout(timeout, group)
        pg.set_timeout(timeout)
        return None

    return setter


class _NoProcessGroupNCCL:
    """Stands for ``ProcessGroupNCCL``, which a CPU build lacks while ``is_nccl_available()`` is True here.

    c10d tests ``is_nccl_available() and isinstance(backend, ProcessGroupNCCL)``
    (``_set_pg_timeout`` on a device mesh's groups): no group is one, as for a
    group of another backend on a GPU build; ours are handled where c10d calls them.
    """


def install() -> None:
    """Register the backend and route ``"nccl"`` to it, keeping the name ``"nccl"`` visible."""
    dist.Backend.register_backend(NAME, _create, devices=["cuda", NAME])
    dist.Backend.register_backend(NAME_WITH_GLOO, _create_with_gloo, devices=["cpu", "cuda", NAME])
    helper = c10d._new_process_group_helper
    signature = inspect.signature(helper)
    register = c10d._register_pg_in_world
    asked: list[str] = []  # what the user asked for, shown back by get_backend

    def new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        ours = _to_mirage(backend)
        if ours in (NAME, NAME_WITH_GLOO):
            asked.append("nccl" if ours == NAME else str(backend))
            kwargs["device_id"] = None  # eager init needs a C++ backend per device; ours connects lazily
        try:
            named = signature.bind_partial(group_size, group_rank, global_ranks_in_group, ours, *args,
                                           **kwargs).arguments
        except TypeError:  # arguments torch's helper refuses: let it say so, in its own words
            named = {}
        # torch's own default for a group without a description (its helper turns None into "undefined")
        desc = named.get("group_desc")
        creating = RUNTIME.comm.creating
        creating.begin(list(global_ranks_in_group or []), str(named.get("group_name") or ""),
                       "undefined" if desc is None else str(desc))
        try:
            return helper(group_size, group_rank, global_ranks_in_group, ours, *args, **kwargs)
        finally:
            creating.end()

    def register_pg_in_world(pg, *args, backend_name=None, backend_config=None, **kwargs):
        if str(backend_name) in (NAME, NAME_WITH_GLOO):
            backend_name = asked.pop()
            # "cuda:mirage,mirage:mirage" reads "cuda:nccl" (our device is an implementation detail),
            # a mixed group "cpu:gloo,cuda:nccl"
            backend_config = ",".join(
                f"{device}:{('gloo' if device == 'cpu' else 'nccl') if be in (NAME, NAME_WITH_GLOO) else be}"
                for device, be in (entry.split(":", 1) for entry in backend_config.split(","))
                if device != NAME
            )
        return register(pg, *args, backend_name=backend_name, backend_config=backend_config, **kwargs)

    c10d.split_group = dist.split_group = _split_group(c10d.split_group)
    ddp = torch.nn.parallel.DistributedDataParallel
    ddp.__init__ = _on_module_gpu(ddp.__init__)
    ddp.forward = _on_module_gpu(ddp.forward)
    ddp.__setstate__ = _on_module_gpu(ddp.__setstate__)  # a pickled DDP builds its reducer again
    reducer = torch._C._distributed_c10d.Reducer
    reducer._set_forward_pass_work_handle = _keeping_join_work(reducer._set_forward_pass_work_handle)
    if pinned.NATIVE_ERROR is not None:
        ddp.__init__ = _refuse_unused_parameters(ddp.__init__)
    c10d._new_process_group_helper = new_process_group_helper
    c10d.destroy_process_group = dist.destroy_process_group = _finalizing(c10d.destroy_process_group)
    c10d._set_pg_timeout = _set_pg_timeout(c10d._set_pg_timeout)
    if not hasattr(c10d, "ProcessGroupNCCL"):
        c10d.ProcessGroupNCCL = _NoProcessGroupNCCL
    prof.load()
    c10d._register_pg_in_world = register_pg_in_world
    c10d._NCCL_AVAILABLE = True
    # ProcessGroupNCCL's default timeout (10 minutes), which a CPU build leaves unset
    c10d.default_pg_nccl_timeout = timedelta(minutes=10)
