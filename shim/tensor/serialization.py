"""``torch.save`` / ``torch.load`` (and ``copy.deepcopy``) of emulated GPUs' tensors as on a GPU build.

Saving (:func:`reduce_tensor`, MirageTensor's pickling) writes what a GPU build
writes: the storage tagged ``cuda:<i>``, ``requires_grad``, a Parameter as a
Parameter. Loading: storages restored to ``cuda:i`` come back on GPU ``i``.

``torch.load(f, map_location="cuda:1")`` (and a checkpoint written on a real
GPU, whose storages are tagged ``cuda:0``) ends in ``storage.to("cuda:1")``,
which a CPU build cannot do. A deserializer registered ahead of torch's own
for ``cuda`` locations keeps the storage on the host and notes its GPU; the
tensors rebuilt on it during that load are then wrapped as that GPU's tensors
(views of one storage still share it).
"""

from __future__ import annotations

import collections
import copy
import functools
import re
import threading

import torch
import torch._utils
import torch.serialization

from shim.device import state as dev
from shim.rank.runtime import RUNTIME
from shim.tensor import estimate
from shim.tensor.wrapper import MirageTensor

_CUDA = re.compile(r"cuda(?::(\d+))?")
_state = threading.local()  # per load: id(storage) -> (storage, gpu); the storage is held so its id stays its own


def _loading() -> dict:
    if not hasattr(_state, "storages"):
        _state.storages, _state.depth = {}, 0
    return _state.storages


def _restore_cuda(storage, location: str):
    """The deserializer for ``cuda[:i]`` locations: the host storage, remembered as GPU ``i``'s."""
    m = _CUDA.fullmatch(location)
    if m is None:
        return None
    gpu = dev.check_index(int(m.group(1)) if m.group(1) is not None else RUNTIME.device.current)
    _loading()[id(storage)] = (storage, gpu)
    return storage


def _never_tag(storage):
    return None  # saving is tagged by _tag_cuda, which must come before torch's "cpu": this entry only restores


#: Storages of emulated GPUs' tensors being pickled: StorageImpl address -> (the storage, its GPU).
#: The storage is held (its address stays its own) until the outermost ``torch.save`` ends.
_SAVING: dict[int, tuple] = {}


def _tag_cuda(storage):
    """The tagger ahead of torch's ``cpu`` one: a GPU's storage being saved is ``cuda:<i>``, as on a GPU build."""
    found = _SAVING.get(getattr(storage, "_untyped_storage", storage)._cdata)
    return f"cuda:{found[1]}" if found is not None else None


def _no_restore(storage, location: str):
    return None  # restoring ``cuda:<i>`` is _restore_cuda's (torch asks every deserializer in turn)


def reduce_tensor(t: MirageTensor, proto):
    """What ``torch.save`` saves of an emulated GPU's tensor: what a GPU build saves.

    Its storage tagged ``cuda:<i>``, its ``requires_grad``, and a Parameter
    saved as a Parameter: ``torch.load`` gives it back on GPU ``i`` (or where
    ``map_location`` says), a real GPU machine loads it as CUDA, and a pickled
    ``DistributedDataParallel`` rebuilds its reducer over GPU Parameters.
    """
    if not getattr(_state, "saving", 0):
        # other pickling (multiprocessing moves a storage into shared memory in place): a host copy,
        # which comes back as a CPU tensor
        alias = t._elem.detach().clone()
    else:
        alias = t._elem.detach()  # the same storage, a leaf: written to the file as it is
        if alias.is_meta:
            estimate.notice("torch.save", "writes the shapes of tensors without values, which torch.load reads "
                            "back as meta tensors")
        storage = alias.untyped_storage()
        _SAVING[storage._cdata] = (storage, t._gpu)
    if isinstance(t, torch.nn.Parameter):
        return torch._utils._rebuild_parameter, (alias, t.requires_grad, collections.OrderedDict())
    if t.requires_grad and t.is_leaf:
        alias.requires_grad_(True)
    return alias.__reduce_ex__(proto)


def deepcopy_tensor(t: MirageTensor, memo: dict):
    """``copy.deepcopy`` of an emulated GPU's tensor: a copy on the same GPU, a Parameter as a Parameter.

    torch's own deepcopy goes through a new storage of the tensor's device, which
    a CPU build cannot make (``Storage device not recognized: cuda``): every
    ``copy.deepcopy(model)`` of a model on the GPU failed.
    """
    found = memo.get(id(t))
    if found is not None:
        return found
    if not t.is_leaf:
        raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                           "protocol at the moment.")
    with torch.no_grad():
        new = t.clone(memory_format=torch.preserve_format)
    new = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new.requires_grad_(
        t.requires_grad)
    memo[id(t)] = new
    if t.grad is not None:
        new.grad = copy.deepcopy(t.grad, memo)
    for name, value in t.__dict__.items():  # the user's attributes; the wrapper's own are new's already
        if name not in new.__dict__:
            setattr(new, name, copy.deepcopy(value, memo))
    return new


def _save_wrapper(save):
    @functools.wraps(save)
    def wrapped(*args, **kwargs):
        _state.saving = getattr(_state, "saving", 0) + 1
        try:
            return save(*args, **kwargs)
        finally:
            _state.saving -= 1
            if _state.saving == 0:
                _SAVING.clear()

    return wrapped


_rebuild_tensor = torch._utils._rebuild_tensor


@functools.wraps(_rebuild_tensor)
def _rebuild_on_gpu(storage, storage_offset, size, stride):
    t = _rebuild_tensor(storage, storage_offset, size, stride)
    found = _loading().get(id(storage._untyped_storage))
    return MirageTensor(t, found[1]) if found is not None else t


def _load_wrapper(load):
    @functools.wraps(load)
    def wrapped(*args, **kwargs):
        _loading()
        _state.depth += 1
        try:
            return load(*args, **kwargs)
        finally:
            _state.depth -= 1
            if _state.depth == 0:
                _state.storages.clear()

    return wrapped


def install() -> None:
    """Register the deserializer (before torch's ``cuda`` one) and the GPU-aware rebuild."""
    torch.serialization.register_package(19, _never_tag, _restore_cuda)
    torch.serialization.register_package(5, _tag_cuda, _no_restore)  # before "cpu" (10) asks
    torch._utils._rebuild_tensor = _rebuild_on_gpu  # what _rebuild_tensor_v2 calls, by module global
    torch.serialization.load = torch.load = _load_wrapper(torch.serialization.load)
    torch.serialization.save = torch.save = _save_wrapper(torch.serialization.save)
    # pickled and copied as a GPU build's CUDA tensor
    MirageTensor.__reduce_ex__ = reduce_tensor
    MirageTensor.__deepcopy__ = deepcopy_tensor
