"""FSDP2 and DTensor on emulated GPUs: the places they look below the Python tensor.

- FSDP2 frees an unsharded parameter between uses by resizing its storage to
  zero bytes and back (``free_storage`` / ``alloc_storage`` in
  ``torch.distributed.fsdp._fully_shard._fsdp_param``). A ``MirageTensor`` is a
  wrapper without storage of its own, so the resize is applied to the CPU
  tensor it wraps: the host memory really is released and re-allocated.
- A ``DTensor``'s ``device`` is its C++ device, which for an emulated GPU is
  the one backend device ``mirage:0``; it answers its local tensor's device
  (``cuda:i``) instead, as on a GPU, which FSDP2 checks when it shards DTensors
  (2-D meshes: ``Expects DTensor to be moved to cuda``).
- DTensor works out an op's output shape by running it on fake tensors made
  on the mesh's device type. Fake ``cuda`` tensors reach kernels a CPU build
  lacks (``copy_``, so ``uniform_``'s decomposition and every ``nn.init``
  function: "PyTorch is not linked with support for cuda devices"), so they are
  made on the backend device instead, which is what an emulated GPU is in C++.
- FSDP1 turns ``device_id=<int>`` (Lightning passes one) into ``torch.device(i)``,
  which names the accelerator's type: the backend's, where a GPU build's is
  ``cuda``; it is made ``cuda:i`` again.

Each module is patched when it is first imported (FSDP2 costs half a second
to import, which a rank that never uses it should not pay).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from types import MappingProxyType

import torch

from shim.rank.runtime import RUNTIME
from shim.tensor.wrapper import BACKEND_DEVICE, MirageTensor


def _on_host(resize):
    @functools.wraps(resize)
    def wrapped(tensor):
        if not isinstance(tensor, MirageTensor):
            return resize(tensor)
        result = resize(tensor._elem)
        RUNTIME.allocator.moved(tensor)  # the GPU's books follow: freed at size 0, counted again when re-allocated
        return result

    return wrapped


def _patch_fsdp_param(module) -> None:
    module.alloc_storage = _on_host(module.alloc_storage)
    module.free_storage = _on_host(module.free_storage)


def _patch_dtensor(module) -> None:
    module.DTensor.device = property(lambda self: self._local_tensor.device, doc="The local tensor's device.")


def _patch_op_schema(module) -> None:
    """Build the fake arguments of DTensor's shape propagation on the backend device, not ``cuda``."""
    rebuild = module._rebuild_tensor_from_dtensor_meta

    @functools.wraps(rebuild)
    def on_backend(arg):
        if arg.mesh.device_type != "cuda":
            return rebuild(arg)
        meta = arg.tensor_meta
        if meta is None:
            raise AssertionError("DTensorSpec does not contain tensor_meta.")
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=BACKEND_DEVICE)

    module._rebuild_tensor_from_dtensor_meta = on_backend


def _patch_fsdp1_init(module) -> None:
    """FSDP1's ``device_id=<int>`` is ``torch.device(i)``, the accelerator's type: ``mirage:i`` here, ``cuda:i`` on a GPU."""
    device_of = module._get_device_from_device_id

    @functools.wraps(device_of)
    def as_cuda(device_id, rank, device_handle):
        device = device_of(device_id, rank, device_handle)
        if device is not None and device.type == BACKEND_DEVICE.type:
            return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        return device

    module._get_device_from_device_id = as_cuda


def _patch_fsdp1_handle(module) -> None:
    """FSDP1's device handle for a ``mirage:i`` device (an ``int`` device_id, or a module's own) is ``torch.cuda``."""
    handle = module._FSDPDeviceHandle
    from_device = handle.from_device.__func__

    def cuda_for_backend(cls, device):
        return torch.cuda if device.type == BACKEND_DEVICE.type else from_device(cls, device)

    handle.from_device = classmethod(cuda_for_backend)


_PATCHES = MappingProxyType({
    "torch.distributed.fsdp._common_utils": _patch_fsdp1_handle,
    "torch.distributed.fsdp._init_utils": _patch_fsdp1_init,
    "torch.distributed.fsdp._fully_shard._fsdp_param": _patch_fsdp_param,
    "torch.distributed.tensor._api": _patch_dtensor,
    "torch.distributed.tensor._op_schema": _patch_op_schema,
})


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches a module right after it executes, before anything imports names from it."""

    _busy = False

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None or self._busy:
            return None
        self._busy = True  # the lookup below comes back here: let the real finders answer it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    """Patch the modules already imported now, the others when they are."""
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchAfterImport())
