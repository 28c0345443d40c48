"""Translate ``cuda`` in user code to the emulated backend, at the Python API boundary.

User code names ``cuda`` explicitly (``device="cuda:1"``, ``t.to("cuda")``,
``.cuda()``, ``Module.to(device)``). A global ``TorchFunctionMode`` sees those
calls before C++ does, swaps the device for the backend's one, and sets which
emulated GPU the resulting allocations land on.
"""

from __future__ import annotations

from types import (BuiltinFunctionType, FunctionType, MethodDescriptorType, MethodWrapperType,
                   WrapperDescriptorType)

import torch
from torch.overrides import TorchFunctionMode

from shim.compile import torch_compile
from shim.cuda import api  # noqa: F401 - it builds RUNTIME.cuda, which keeps the mode
from shim.device import state as dev
from shim.memory import pinned
from shim.ops import attention
from shim.rank.runtime import RUNTIME
from shim.tensor import params
from shim.tensor.wrapper import BACKEND, BACKEND_DEVICE, MirageTensor

_aten = torch.ops.aten
_TO = torch.Tensor.to
_CUDA = torch.Tensor.cuda
_SDPA = torch.nn.functional.scaled_dot_product_attention
_PIN_MEMORY = torch.Tensor.pin_memory
_IS_PINNED = torch.Tensor.is_pinned
_COMPATIBLE = params.COMPATIBLE
_is_compiling = torch.compiler.is_compiling  # dynamo folds this very function to True
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling  # this one too, and is a third of its cost
#: the functions the mode handles whatever their arguments; the rest (but higher-order ops) only when
#: they name a device
_SPECIAL = frozenset({_TO, _CUDA, _SDPA, _PIN_MEMORY, _IS_PINNED, _COMPATIBLE})
#: the types of what most calls pass as ``func`` (C functions and methods, the getters and setters of a
#: tensor's attributes, Python functions): none is a higher-order op, which isinstance takes ~0.5 us to rule out
_PLAIN_TYPES = frozenset({BuiltinFunctionType, MethodDescriptorType, MethodWrapperType, WrapperDescriptorType,
                          FunctionType})


def _cuda_index(d) -> int | None:
    """The emulated GPU a device argument names, or None if it is not cuda."""
    if isinstance(d, int) and not isinstance(d, bool):
        return dev.check_index(d)  # a bare ordinal means a cuda device, as on a GPU build
    if isinstance(d, str):
        if not d.startswith(("cuda", BACKEND)):
            return None
        d = torch.device(d)
    if isinstance(d, torch.device) and d.type == BACKEND:
        # C++ names every emulated GPU mirage:0 (e.g. torch's grouping of tensors by device in
        # clip_grad_norm_ and the foreach optimizers): the GPU meant is the current one. Another
        # index was the program's: torch.device(1) names the accelerator's type, cuda on a GPU
        return dev.check_index(d.index) if d.index else RUNTIME.device.current
    if isinstance(d, torch.device) and d.type == "cuda":
        return dev.check_index(RUNTIME.device.current if d.index is None else d.index)
    return None


def _move(t: torch.Tensor, gpu: int, dtype, copy: bool, memory_format) -> torch.Tensor:
    """``t.to(cuda:gpu, dtype)``: differentiable, a no-op when nothing changes."""
    same_place = isinstance(t, MirageTensor) and t._gpu == gpu
    same_layout = memory_format in (None, torch.preserve_format) or t.is_contiguous(memory_format=memory_format)
    if same_place and (dtype is None or dtype == t.dtype) and same_layout and not copy:
        return t
    kw = {"dtype": dtype or t.dtype, "device": BACKEND_DEVICE}
    if memory_format is not None:
        kw["memory_format"] = memory_format
    if RUNTIME.clock is not None and not isinstance(t, MirageTensor):  # clocked mode: a host-to-device copy
        RUNTIME.clock.copy_to_device(gpu, t.numel() * t.element_size())
    with dev.allocating_on(gpu):
        return _aten._to_copy.default(t, **kw)


class CudaMode(TorchFunctionMode):
    """Routes every ``cuda`` device argument to the emulated backend."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # most calls (a tensor's attribute, an op naming no device) pass through unchanged, as the rest below
        # would pass them: decided first, in a few lookups (docs/device.md, "The mode's cost"); dynamo, tracing
        # the mode, folds _is_dynamo_compiling() to True and takes the rest, as before
        if (not _is_dynamo_compiling() and func not in _SPECIAL and not (kwargs and "device" in kwargs)
                and type(func) in _PLAIN_TYPES):
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if _is_compiling():  # dynamo inlines this mode: see shim/compile/torch_compile.py
            return _compiling(func, args, kwargs)
        if func is _TO:
            parse_kw = {k: v for k, v in kwargs.items() if k != "copy"}
            to_args, copy = args[1:], kwargs.get("copy", False)
            if len(to_args) >= 3 and isinstance(to_args[-1], bool) and isinstance(to_args[-2], bool):
                copy, to_args = to_args[-1], to_args[:-1]  # (..., non_blocking, copy) given positionally
            device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*to_args, **parse_kw)
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if isinstance(other, MirageTensor):  # t.to(other): C++ only knows other is on mirage:0
                device = torch.device("cuda", other._gpu)
            gpu = _cuda_index(device) if device is not None else None
            if gpu is not None:
                return _move(args[0], gpu, dtype, copy, memory_format)
            return func(*args, **kwargs)
        if func is _PIN_MEMORY and pinned.NATIVE_ERROR is not None:
            return pinned.pin(args[0])
        if func is _IS_PINNED and pinned.NATIVE_ERROR is not None:
            return pinned.is_pinned(args[0])
        if isinstance(func, torch._ops.HigherOrderOperator):
            # A mode is off inside its own __torch_function__, and a HOP's body (flex attention's
            # score_mod tracing: factories with device=t.device) must still see cuda translated:
            # dispatch it with the mode back on (calling func would come straight back here)
            with self:
                keyset = torch._ops._compute_keyset(args, kwargs, func.non_fallthrough_keys)
                return func.dispatch(keyset.highestPriorityTypeId(), *args, **kwargs)
        if func is _SDPA:
            out = attention.route(*args, **kwargs)
            if out is not None:
                return out
            return func(*args, **kwargs)
        if func is _CUDA:
            d = args[1] if len(args) > 1 else kwargs.get("device")
            gpu = (RUNTIME.device.current if d is None
                   else _cuda_index(d) if not isinstance(d, int) else dev.check_index(d))
            return _move(args[0], gpu, None, False, kwargs.get("memory_format"))
        if func is _COMPATIBLE:  # Module._apply asks before it moves a parameter with .data =
            return params.has_compatible_shallow_copy_type(*args, **kwargs)
        d = kwargs.get("device")
        if d is not None:
            gpu = _cuda_index(d)
            if gpu is not None:
                with dev.allocating_on(gpu):
                    try:
                        return func(*args, **dict(kwargs, device=BACKEND_DEVICE))
                    except NotImplementedError as e:
                        if f"from the '{BACKEND}' backend" not in str(e):
                            raise
                    # a factory with CPU and CUDA kernels only (tril_indices, triu_indices): build
                    # it on the host and move it, as its CUDA kernel's result would be there
                    return _move(func(*args, **dict(kwargs, device="cpu")), gpu, None, False, None)
        return func(*args, **kwargs)


def _compiling(func, args, kwargs: dict):
    """``CudaMode.__torch_function__`` as dynamo traces it: calls that name ``cuda`` make host tensors put on
    the GPU (shim/compile/torch_compile.py); attention, higher-order ops and the rest are compiled as torch's own."""
    if func is _TO:
        return torch_compile.to(args, kwargs)
    if func is _CUDA:
        d = args[1] if len(args) > 1 else kwargs.get("device")
        return torch_compile.move(args[0], torch_compile.gpu_of("cuda" if d is None else d),
                                  memory_format=kwargs.get("memory_format"))
    d = kwargs.get("device")
    if d is not None:
        gpu = torch_compile.gpu_of(d)
        if gpu is not None:
            return torch_compile.factory(func, args, kwargs, gpu)
    return func(*args, **kwargs)


torch_compile.inline(__name__, frames=False)


def install() -> None:
    """Push the mode for the rest of the process (and threads started later)."""
    mode = RUNTIME.cuda.mode = CudaMode()
    mode.__enter__()
