"""Views and common ops on ``cuda:i`` tensors in C++: ``shim/native/fast_dispatch.cpp``, for torch's Python key.

Each op on an emulated tensor costs a Python round trip (torch's conversion of
the arguments, ``MirageTensor.__torch_dispatch__``, ``_make_wrapper_subclass``)
of several times what most ops of a training step take. The library's kernels
take the views (:data:`VIEW_OPS`) and common functional ops
(:data:`PLAIN_OPS`) of exact ``MirageTensor`` arguments on one GPU when no
``TorchDispatchMode`` is active, doing what ``__torch_dispatch__`` would, and
leave everything else to torch's Python fallback (a mode, DTensor and other
subclasses, mixed devices and errors see the same calls as without it). It also
makes the wrappers of the outputs of the ops left to Python (``shim/tensor/wrapper.py``'s
``_new``): the same wrapper as ``Tensor._make_wrapper_subclass``, without
parsing its dozen keyword arguments for each op.

In clocked mode the plain ops are timed in C++ as well: each op's cost is
looked up by its signature (the op, its tensors' dtypes, sizes and strides, its
other arguments) in a table the roofline fills on a miss (``op_cost``), and
the rank's clock is advanced by ``Clock.charge_priced``. Estimate mode keeps
the plain ops in Python, where its rules for tensors without values live.

Without a C++ compiler, or Python's headers, every op keeps going through
``__torch_dispatch__`` and every wrapper through ``_make_wrapper_subclass``
(:data:`FAST_DISPATCH_ERROR` says why).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from shim.clock import op_costs
from shim.clock.roofline import op_cost
from shim.device import state as dev
from shim.memory import allocator  # noqa: F401 - it builds RUNTIME.allocator
from shim.native import build as native_build
from shim.rank.runtime import RUNTIME
from shim.tensor import wrapper as tensor
from shim.tensor.wrapper import MirageTensor

#: None once the C++ kernels are registered; otherwise why not (one line)
FAST_DISPATCH_ERROR: str | None = "shim.tensor.fast_dispatch.install() has not run"

_aten = torch.ops.aten
#: the views taken in C++: views whose one tensor argument is the first and which return one tensor
#: (what the kernel assumes; _check_view holds each to that)
VIEW_OPS = (
    _aten.view.default, _aten.t.default, _aten.transpose.int, _aten.detach.default, _aten.expand.default,
    _aten.select.int, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default,
    _aten.permute.default, _aten.as_strided.default, _aten.slice.Tensor, _aten.alias.default,
    _aten.diagonal.default, _aten.unfold.default, _aten.view.dtype,
)

#: functional ops taken in C++ (the common ones of training steps); _check_plain holds each to what
#: the kernel assumes
PLAIN_OPS = (
    _aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.add.Tensor, _aten.sub.Tensor,
    _aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar, _aten.neg.default,
    _aten.clone.default, _aten._unsafe_view.default, _aten.sum.dim_IntList, _aten.sum.default, _aten.mean.dim,
    _aten.mean.default, _aten.pow.Tensor_Scalar, _aten.sqrt.default, _aten.rsqrt.default, _aten.exp.default,
    _aten.log.default, _aten.where.self, _aten.relu.default, _aten.threshold_backward.default,
    _aten.gelu.default, _aten.gelu_backward.default, _aten.silu.default, _aten.silu_backward.default,
    _aten.tanh.default, _aten.tanh_backward.default, _aten.sigmoid.default, _aten.sigmoid_backward.default,
    _aten._softmax.default, _aten._safe_softmax.default, _aten._softmax_backward_data.default,
    _aten._log_softmax.default, _aten._log_softmax_backward_data.default, _aten.native_layer_norm.default,
    _aten.native_layer_norm_backward.default, _aten.select_backward.default, _aten.slice_backward.default,
    _aten.embedding.default, _aten.embedding_dense_backward.default, _aten.nll_loss_forward.default,
    _aten.nll_loss_backward.default,
)

#: in-place elementwise ops taken in C++ (DDP's bucket copies, optimizers without foreach, gradient
#: accumulation): each writes its first argument and returns it, and never changes its geometry;
#: _check_in_place holds each to the schema the kernel assumes
IN_PLACE_OPS = (
    _aten.copy_.default, _aten.add_.Tensor, _aten.add_.Scalar, _aten.sub_.Tensor, _aten.mul_.Tensor,
    _aten.mul_.Scalar, _aten.div_.Tensor, _aten.div_.Scalar, _aten.zero_.default, _aten.fill_.Scalar,
    _aten.addcmul_.default, _aten.addcdiv_.default, _aten.lerp_.Scalar, _aten.sqrt_.default,
    _aten.clamp_.default, _aten.neg_.default,
)

#: in-place foreach ops taken in C++ in functional mode (Adam's, AdamW's and SGD's updates, clip_grad_norm_'s
#: scaling): each writes the tensors of its first list and returns nothing; clocked mode prices them in Python
FOREACH_OPS = tuple(
    getattr(getattr(_aten, f"_foreach_{name}_"), overload)
    for name, overloads in (("add", ("Scalar", "List", "ScalarList", "Tensor")),
                            ("sub", ("Scalar", "List", "ScalarList")),
                            ("mul", ("Scalar", "List", "ScalarList", "Tensor")),
                            ("div", ("Scalar", "List", "ScalarList", "Tensor")),
                            ("addcmul", ("Scalar", "ScalarList")), ("addcdiv", ("Scalar", "ScalarList")),
                            ("lerp", ("Scalar", "List")), ("sqrt", ("default",)), ("neg", ("default",)),
                            ("zero", ("default",)))
    for overload in overloads)

_lib: ctypes.CDLL | None = None  # kept: the registrations point into it for the process's life


def _name(op) -> str:
    """``op``'s name as a kernel is registered under it: ``view``, ``transpose.int``."""
    name = op._schema.name.split("::", 1)[1]
    return f"{name}.{op._schema.overload_name}" if op._schema.overload_name else name


def _check_view(op) -> str:
    """``op``'s name, once its schema is what the view kernel assumes."""
    schema = op._schema
    tensors = [i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type)]
    returns = [str(r.type) for r in schema.returns]
    if not op.is_view or tensors != [0] or returns != ["Tensor"]:
        raise AssertionError(f"{op} is not a view of its one tensor argument returning one tensor")
    return _name(op)


def _check_plain(op) -> str:
    """``op``'s name, once it is what the plain kernel assumes: what ``_fast`` runs as it is (a plain op,
    no view), writing to and aliasing no argument, with no lists of tensors or devices among its
    arguments (keyword-only ones too) and tensors for results."""
    schema = op._schema
    plan = tensor._Plan(op)
    if (plan.kind != tensor._PLAIN or plan.mixed_ok or op.is_view
            or any(a.alias_info is not None or tensor._tensor_slot(a.type) is None for a in schema.arguments)
            or any(r.alias_info is not None or str(r.type) != "Tensor" for r in schema.returns)):
        raise AssertionError(f"{op} is not a functional op on tensors and numbers")
    return _name(op)


def _check_in_place(op) -> str:
    """``op``'s name, once it is what the kernel assumes of an in-place op: a plain op that ``_fast`` runs,
    writing its first argument (a tensor) and returning it, aliasing nothing else, with no lists of
    tensors or devices among its arguments."""
    schema = op._schema
    plan = tensor._Plan(op)
    first, *rest = schema.arguments
    returns = schema.returns
    if (plan.kind != tensor._PLAIN or not plan.fast or op.is_view or str(first.type) != "Tensor"
            or first.alias_info is None or not first.alias_info.is_write
            or len(returns) != 1 or returns[0].alias_info is None
            or returns[0].alias_info.before_set != first.alias_info.before_set
            or any(a.alias_info is not None or tensor._tensor_slot(a.type) is None for a in rest)):
        raise AssertionError(f"{op} is not an in-place op on its first argument")
    return _name(op)


def _check_foreach(op) -> str:
    """``op``'s name, once it is what the foreach kernel assumes: a plain op that ``_fast`` runs, writing the
    tensors of its first argument (a list) and returning nothing, aliasing nothing else, its other arguments
    lists of tensors, tensors and numbers."""
    schema = op._schema
    plan = tensor._Plan(op)
    first, *rest = schema.arguments
    if (plan.kind != tensor._PLAIN or not plan.fast or str(first.type) != "List[Tensor]"
            or first.alias_info is None or not first.alias_info.is_write or schema.returns
            or any(a.alias_info is not None
                   or (str(a.type) != "List[Tensor]" and tensor._tensor_slot(a.type) is None) for a in rest)):
        raise AssertionError(f"{op} is not an in-place foreach op on its first list")
    return _name(op)


def install() -> None:
    """Build (once, cached) and register the kernels; on failure record why in :data:`FAST_DISPATCH_ERROR`."""
    global FAST_DISPATCH_ERROR, _lib
    try:
        views = [_check_view(op) for op in VIEW_OPS]
        # Estimate mode's rules for tensors without values (shim/tensor/estimate.py) are Python's: only the
        # views, which launch no kernel, stay in C++ there.
        plain_ops = [] if RUNTIME.settings.estimate else list(PLAIN_OPS) + list(IN_PLACE_OPS)
        plain = [_check_in_place(op) if op in IN_PLACE_OPS else _check_plain(op) for op in plain_ops]
        # clocked mode prices the foreach ops in Python (their numbers change every step: op_costs.py)
        foreach = [] if RUNTIME.clock is not None else [_check_foreach(op) for op in FOREACH_OPS]
        lib = native_build.load(native_build.FAST_DISPATCH_SOURCE, "the fast dispatch kernels", ctypes.PyDLL)
    except (AssertionError, native_build.BuildError) as e:  # another torch's schemas, or no build
        FAST_DISPATCH_ERROR = str(e)
        return
    register = lib.mirage_register_kernels
    register.argtypes = [ctypes.py_object] * 9
    register.restype = ctypes.c_int
    clock = RUNTIME.clock  # clocked mode: the plain ops are timed in C++ too, priced once per signature
    # the roofline of an op whose signature the C++ table has not seen yet
    cost = None if clock is None else functools.partial(op_cost, profile=clock.profile)
    try:
        # dev._alloc: the thread's allocating_on() GPU, which overrides an output's GPU as in _fast
        register(MirageTensor, dev._alloc, RUNTIME.allocator.hold, views, plain, plain_ops, foreach, cost,
                 None if clock is None else clock.charge_priced)
    except (RuntimeError, TypeError) as e:  # the error the library set (PyDLL raises it)
        FAST_DISPATCH_ERROR = f"cannot register the fast dispatch kernels: {e}"
        return
    factory = lib.mirage_new_wrapper
    factory.restype = ctypes.py_object
    tensor.use_wrapper_factory(factory())
    native_signature = lib.mirage_op_signature
    native_signature.restype = ctypes.py_object
    op_costs.use_native_signature(native_signature())
    _lib = lib
    FAST_DISPATCH_ERROR = None
