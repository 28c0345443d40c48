"""A tensor keeps its identity when ``.data =`` or ``Module.to`` moves it to or from an emulated GPU.

On a GPU build ``Module.to("cuda")`` and ``param.data = param.to("cuda")``
change the tensor in place (``set_data``): the same Python object, now on the
GPU, so an optimizer built before the move trains it (Accelerate's recipe, FSDP1's
``_move_states_to_device``, DeepSpeed). Torch allows ``set_data`` only between
tensors whose implementations are compatible, and a host tensor and an emulated
one (a Python wrapper subclass) are not. So for that pair ``.data =`` swaps the
two objects' contents instead (as ``torch.utils.swap_tensors`` does), keeping the
target's identity, its attributes and its gradient; and
``torch._has_compatible_shallow_copy_type`` answers True for the pair (in
shim/cuda/mode.py: dynamo keeps the original function, so it is not replaced), which
sends ``Module._apply`` down its ``.data =`` path.

Between two emulated tensors ``set_data`` is allowed but only copies the
wrapper's geometry, so the wrapper's data (``_elem``) and its memory books
follow here too.
"""

from __future__ import annotations

import sys

import torch

from shim.import_hooks import after_import
from shim.rank.runtime import RUNTIME
from shim.tensor.wrapper import MirageTensor

_DATA = torch._C.TensorBase.data  # the C++ getter/setter (set_data)
#: what shim/cuda/mode.py answers with has_compatible_shallow_copy_type instead
COMPATIBLE = torch._has_compatible_shallow_copy_type
_NO_DISPATCH = torch.Tensor.__torch_dispatch__
#: the wrapper's own fields, which belong to whichever object holds the emulated data
_WRAPPER_FIELDS = frozenset(("_elem", "_gpu", "_mem", "_src", "_is_param"))


def _host(t) -> bool:
    """A plain dense host tensor (or Parameter): not a subclass with a dispatch of its own."""
    return (t.device.type == "cpu" and t.layout is torch.strided
            and type(t).__torch_dispatch__ is _NO_DISPATCH)


def _crosses(t, other) -> bool:
    """``t`` and ``other`` are a host tensor and an emulated one, in either order."""
    if isinstance(t, MirageTensor):
        return not isinstance(other, MirageTensor) and _host(other)
    return isinstance(other, MirageTensor) and _host(t)


def has_compatible_shallow_copy_type(t, other) -> bool:
    """``torch._has_compatible_shallow_copy_type``, True also between host and emulated tensors (as CPU/CUDA)."""
    return _crosses(t, other) or COMPATIBLE(t, other)


def _get_data(t):
    return _DATA.__get__(t)


def _set_data(t, new) -> None:
    """``t.data = new``, as ``set_data`` on a GPU build: ``t`` stays the same object."""
    if isinstance(new, torch.Tensor) and _crosses(t, new):
        _swap_in(t, new)
        return
    _DATA.__set__(t, new)
    if isinstance(t, MirageTensor) and isinstance(new, MirageTensor) and t._elem is not new._elem:
        t._elem = new._elem
        t._gpu = new._gpu
        RUNTIME.allocator.moved(t)  # counted through its new storage, the old one released


def _swap_in(t, new) -> None:
    """``t.data = new`` between host and emulated GPU: ``t`` takes an alias of ``new``'s data."""
    grad = t.grad
    if grad is not None:
        if grad.shape != new.shape or grad.dtype != new.dtype:
            raise RuntimeError(
                f"mirage: cannot move a tensor with a .grad of shape {tuple(grad.shape)} to {new.device} through "
                f".data = a tensor of shape {tuple(new.shape)}: set .grad = None first"
            )
        t.grad = None
        _set_data(grad, grad.to(new.device))  # the same grad object follows its tensor
    param = isinstance(t, torch.nn.Parameter)
    # what Module._apply swaps in: a Parameter of a host tensor, or the emulated alias marked as one
    alias = torch.nn.Parameter(new, t.requires_grad) if param else new.detach().requires_grad_(t.requires_grad)
    own = {k: v for k, v in t.__dict__.items() if k not in _WRAPPER_FIELDS}
    _swap(t, alias)
    t.__dict__.update(own)  # a Parameter's or a framework's attributes (FSDP's, DeepSpeed's) stay with it
    if grad is not None:
        t.grad = grad


def _swap(t, alias) -> None:
    """Give the Python object ``t`` the class, attributes and C++ tensor of ``alias`` (and ``alias`` ``t``'s).

    ``torch.utils.swap_tensors`` without its two refusals, which protect
    callers who keep using the *old* contents: weak references (DeepSpeed
    puts one on every parameter before it moves the model) stay valid since
    the object keeps its identity; C++ holders of the old tensor (a DDP
    reducer, an autograd graph built before the move) keep the old data
    (Accelerate's test moves a model out of DDP to compare it; nothing trains
    on through such a holder after a move to another device). Neither class
    has __slots__.
    """
    t.__class__, alias.__class__ = alias.__class__, t.__class__
    t.__dict__, alias.__dict__ = alias.__dict__, t.__dict__
    torch._C._swap_tensor_impl(t, alias)


def _one_tensor(is_traceable_wrapper_subclass):
    """``is_traceable_wrapper_subclass`` as the code that moves parameters asks it: False for an emulated tensor.

    An emulated tensor is a traceable wrapper subclass (for ``torch.compile``,
    shim/compile/torch_compile.py), which sends ``Module._apply``, parametrizations and
    FSDP's moves and state syncs down their paths for tensors made of several
    (``swap_tensors``, the inner tensors one by one); it is one ``cuda`` tensor,
    moved by ``.data =`` as above, as on a GPU.
    """

    def is_wrapper_of_several(t) -> bool:
        return not isinstance(t, MirageTensor) and is_traceable_wrapper_subclass(t)

    return is_wrapper_of_several


def _ask_one_tensor(module_name: str):
    def patch() -> None:
        module = sys.modules[module_name]
        module.is_traceable_wrapper_subclass = _one_tensor(module.is_traceable_wrapper_subclass)

    return patch


def install() -> None:
    """Route ``.data =`` through this module, and parameter moves to it (see :func:`_one_tensor`)."""
    torch.Tensor.data = property(_get_data, _set_data, doc=_DATA.__doc__)
    for name in ("torch.nn.modules.module", "torch.nn.utils.parametrize", "torch.distributed.fsdp._init_utils",
                 "torch.distributed.fsdp._fully_shard._fsdp_init"):
        after_import(name, _ask_one_tensor(name))
