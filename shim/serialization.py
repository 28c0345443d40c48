"""``torch.load`` onto emulated GPUs: storages restored to ``cuda:i`` come back on GPU ``i``.

``torch.load(f, map_location="cuda:1")`` (and a checkpoint written on a real
GPU, whose storages are tagged ``cuda:0``) ends in ``storage.to("cuda:1")``,
which a CPU build cannot do. A deserializer registered ahead of torch's own
for ``cuda`` locations keeps the storage on the host and notes its GPU; the
tensors rebuilt on it during that load are then wrapped as that GPU's tensors
(views of one storage still share it).
"""

from __future__ import annotations

import functools
import re
import threading

import torch
import torch._utils
import torch.serialization

from shim import device as dev
from shim.tensor import MirageTensor

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
    gpu = dev.check_index(int(m.group(1)) if m.group(1) is not None else dev.STATE.current)
    _loading()[id(storage)] = (storage, gpu)
    return storage


def _never_tag(storage):
    return None  # saving is MirageTensor.__reduce_ex__'s business; this entry only restores


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
    torch._utils._rebuild_tensor = _rebuild_on_gpu  # what _rebuild_tensor_v2 calls, by module global
    torch.serialization.load = torch.load = _load_wrapper(torch.serialization.load)
