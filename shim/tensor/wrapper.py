"""``cuda:i`` tensors: a wrapper subclass around a CPU tensor.

At the C++ level every emulated tensor sits on the one PrivateUse1 device
(``mirage:0``): the Python device guard reports a single device and the
autograd engine indexes its ready queues by device index. The emulated GPU
index lives on the wrapper (``_gpu``), and Python sees ``device`` as
``cuda:<_gpu>``. Every aten op on a wrapper reaches ``__torch_dispatch__``,
which runs it on the CPU tensors inside and wraps the results again.

Up to 700 lines on purpose: the class and its ``__torch_dispatch__`` (with its fast
path) are the hot path of every op, read together; the parts that stand alone live beside it
(:mod:`shim.tensor.fast_dispatch`, :mod:`shim.ops.attention`, :mod:`shim.device.rng`).
"""

from __future__ import annotations

import hashlib
import math
import threading

import torch
from torch._subclasses import meta_utils
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from shim.device import deferred, rng
from shim.device import state as dev
from shim.memory import allocator  # noqa: F401 - it builds RUNTIME.allocator
from shim.ops import attention
from shim.ops.functional import functional_collective, traced_collective
from shim.rank.runtime import RUNTIME
from shim.tensor import estimate

BACKEND = dev.BACKEND  # must be registered before this module is imported
BACKEND_DEVICE = torch.device(BACKEND, 0)

_aten = torch.ops.aten
# ops that legitimately take CPU tensors alongside cuda ones
_MIXED_OK = frozenset({
    _aten.copy_.default,
    _aten._to_copy.default,
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
    _aten.index_put.default,
    _aten.lift_fresh.default,
})


#: ops that copy a tensor to another device (``cpu``: off the emulated GPU)
_LEAVING_OPS = frozenset({_aten._to_copy.default, _aten.to.dtype_layout, _aten.to.device})


_DEVICES: dict[int, torch.device] = {}


def _device(gpu: int) -> torch.device:
    """``cuda:gpu``, made once (a ``torch.device`` made in Python is a call through shim/cuda/mode.py's mode)."""
    d = _DEVICES[gpu] = torch.device("cuda", gpu)
    return d


class _CudaStorage(torch.UntypedStorage):
    """A ``cuda:i`` tensor's storage as Python sees it: the host storage inside, on GPU ``i``."""

    _gpu: int

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _DEVICES.get(self._gpu) or _device(self._gpu)


class MirageTensor(torch.Tensor):
    """A tensor on emulated GPU ``_gpu``; its data is the CPU tensor ``_elem``."""

    _elem: torch.Tensor
    _gpu: int
    _mem: int = 0  # the allocator's key for _elem's storage (0: not counted by this wrapper)
    # A view made by an op is counted through the wrapper that holds its storage: it keeps that
    # wrapper alive instead of taking a hold of its own (cheaper, and the same books). Not where that
    # wrapper requires grad: see _new.
    _src: MirageTensor | None = None

    @staticmethod
    def __new__(cls, elem: torch.Tensor, gpu: int):
        return _new(elem, gpu, None)

    def __del__(self):
        # the last wrapper of a storage frees it on its GPU (torch.cuda.memory_allocated drops)
        if self._mem:
            RUNTIME.allocator.release(self._mem)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _DEVICES.get(self._gpu) or _device(self._gpu)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self._gpu

    def __repr__(self, *, tensor_contents=None) -> str:
        # format the CPU data; torch then appends device='cuda:i' and grad_fn as usual
        if tensor_contents is None and (type(self._elem) is not torch.Tensor or self._elem.is_meta):
            # traced (a fake or functional tensor inside): no data to read, as a fake tensor prints
            return f"tensor(..., device='{self.device}', size={tuple(self.shape)}, dtype={self.dtype})"
        if tensor_contents is None:
            if RUNTIME.device.sync_debug:  # printing copies the data to the host
                dev.synchronizing()
            tensor_contents = torch._tensor_str._tensor_str(self._elem.detach(), len("tensor("))
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        text = text.replace(f"{type(self).__name__}(", "tensor(", 1)
        if text.startswith("Parameter(") and getattr(self, "_is_param", False):
            # torch writes a subclass's parameter as Parameter(...); a GPU's is Parameter.__repr__'s
            text = "Parameter containing:\n" + text[len("Parameter("):-1]
        return text

    def tolist(self):
        if RUNTIME.device.sync_debug:
            dev.synchronizing()
        if self._elem.is_meta:  # estimate mode: no values
            return estimate.placeholder(self._elem, "Tensor.tolist()").tolist()
        return self._elem.tolist()

    def numpy(self, *, force: bool = False):
        """As on a GPU: a TypeError naming the device, unless ``force`` (which copies to the host)."""
        if force:
            return self.cpu().numpy(force=True)
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The host storage holding the data, reporting this tensor's device (``cuda:i``), as on a GPU."""
        if _describing.on:
            # a fake copy is being made: a storage of its own each time (the data's is described as the inner
            # tensor's; the same storage seen again, as when DDPOptimizer fakes its inputs anew, reads as aliasing)
            return torch.UntypedStorage(super().untyped_storage().nbytes(), device="meta")
        s = self._elem.untyped_storage()
        if type(s) is not _CudaStorage:
            s.__class__ = _CudaStorage  # torch keeps one Python object per storage: this sticks
        s._gpu = self._gpu
        return s

    def data_ptr(self) -> int:  # type: ignore[override]
        """The data's address (nonzero, shared by views), as code that compares storages expects."""
        if self._elem.is_meta:  # estimate mode: no memory; its storage's C++ object stands for its address
            return self._elem.untyped_storage()._cdata + self._elem.storage_offset() * self._elem.element_size()
        return self._elem.data_ptr()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    __torch_function__ = torch._C._disabled_torch_function_impl

    # A traceable wrapper subclass (shim/compile/torch_compile.py): AOTAutograd compiles graphs over the CPU
    # tensor inside, and wraps what they return on the same GPU.
    def __tensor_flatten__(self):
        return ["_elem"], self._gpu

    @staticmethod
    def __tensor_unflatten__(inner_tensors, gpu, outer_size, outer_stride):
        return _new(inner_tensors["_elem"], gpu, None)

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's cache key for an emulated tensor in a graph: what torch's default for a wrapper
        subclass holds (shape, requires_grad, the metadata inside), here with the GPU, and without its
        warning that a subclass should say so itself."""
        from torch._functorch._aot_autograd.autograd_cache import extract_tensor_metadata_for_cache_key

        inside = extract_tensor_metadata_for_cache_key(self._elem)
        key = repr((tuple(self.shape), self.requires_grad, self._gpu, inside))
        return hashlib.sha256(key.encode()).hexdigest()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            plan = _PLANS.get(id(func))  # by id: OpOverload.__hash__ is a Python method
            if plan is None:
                plan = _PLANS[id(func)] = _Plan(func)  # the plan holds func, so the id stays its own
            out = _fast(plan, args, kwargs) if plan.fast else _GENERAL
            if out is _GENERAL:
                out = _dispatch(func, plan, args, kwargs)
            if plan.bumps:
                torch._C._increment_version(args[0])  # (not an inference tensor's: it has no counter)
            clock = RUNTIME.clock
            if clock is not None and plan.kind != _COLLECTIVE and not _tracing(args):
                # clocked mode: a kernel takes time (a traced one: see shim/compile/torch_compile.py)
                clock.charge(func, args, kwargs, out)
            return out
        except Exception as e:
            if not deferred.in_backward():
                raise
            # Inside the autograd engine an exception here aborts the process where torch's
            # Python device guard is in use (it calls back into Python while the exception
            # unwinds; the C++ one of shim/cuda/engine.py does not, but it may not be built), so it
            # is handed to the thread that called backward() instead: see shim/device/deferred.py.
            return deferred.defer(e, func, args, kwargs)


# Every op on a wrapper comes through here, so how each op is run is worked out from its schema once
# (a _Plan) and found again with one dict lookup. Most ops then take _fast: their positional arguments
# are tensors or hold none, and only those positions are unwrapped.
_PLAIN, _TO, _DROPOUT, _DROPOUT_BACKWARD, _COLLECTIVE, _KERNEL, _RANDOM = range(7)
#: ops that wait for the GPU to hand a value or a size to the host (what set_sync_debug_mode flags; D2H copies
#: and boolean-mask indexing are told apart by their arguments, in _synchronizes)
_SYNCING = frozenset({_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
                      _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
                      _aten.repeat_interleave.Tensor})
#: schema types that never hold a tensor or a device (SymInt is IntType here)
_NO_TENSOR = frozenset({"IntType", "BoolType", "NumberType", "FloatType", "StringType", "ComplexType",
                        "GeneratorType", "AnyEnumType"})
#: keyword values _fast passes on as they are (what optimizers and autograd give: alpha=, pin_memory=False):
#: no tensor, device or list among them, which only the general path converts
_PLAIN_KWARG = frozenset({int, float, bool, type(None), torch.dtype, torch.memory_format, torch.layout})


def _tensor_slot(t) -> bool | None:
    """True for a ``Tensor``/``Tensor?`` argument, False for one that holds no tensor or device, else None."""
    kind = t.kind()
    if kind == "TensorType":
        return True
    if kind in _NO_TENSOR:
        return False
    if kind == "OptionalType":
        return _tensor_slot(t.getElementType())
    if kind == "ListType" and _tensor_slot(t.getElementType()) is False:
        return False  # int[], float[], ...: lists of tensors take the general path
    return None


class _Plan:
    """What dispatching one op needs to know, read from its schema once."""

    __slots__ = ("func", "kind", "run", "mixed_ok", "view", "fast", "tensors", "lists", "bumps")

    def __init__(self, func):
        self.func = func
        if func is _aten.native_dropout.default:
            self.kind = _DROPOUT
        elif func is _aten.native_dropout_backward.default:
            self.kind = _DROPOUT_BACKWARD
        elif func.namespace.startswith("_c10d_functional"):  # DTensor's collectives reach the "nccl" group
            self.kind = _COLLECTIVE
        elif func in attention.CPU_KERNELS:  # GPU-only ops, computed on the CPU reference path
            self.kind = _KERNEL
        elif rng.random_overload(func) is not None:  # drawn from the GPU's generator
            self.kind = _RANDOM
        elif func in _LEAVING_OPS:
            self.kind = _TO
        else:
            self.kind = _PLAIN
        # the C++ operator itself: OpOverload.__call__ is one more Python frame around it
        self.run = attention.CPU_KERNELS.get(func) or (func._op if type(func) is torch._ops.OpOverload else func)
        self.mixed_ok = func in _MIXED_OK
        # a view op's outputs share the storage of its first argument
        self.view = bool(getattr(func, "is_view", False))
        positional = [a for a in func._schema.arguments if not a.kwarg_only]
        slots = [_tensor_slot(a.type) for a in positional]
        # Tensor[] arguments (the optimizers' and clip_grad_norm_'s foreach ops, cat, stack): one unwrap each
        self.lists = tuple(i for i, a in enumerate(positional) if str(a.type) == "List[Tensor]")
        for i in self.lists:
            slots[i] = False
        self.tensors = tuple(i for i, slot in enumerate(slots) if slot)
        # an op that waits for the GPU takes the general path, where set_sync_debug_mode is honoured
        self.fast = self.kind == _PLAIN and None not in slots and func not in _SYNCING
        # an in-place foreach op: the GPU's kernels count a write of every tensor of its first list (the CPU's
        # count one per tensor op of their loop); run on the wrappers' CPU tensors, nothing counts the wrappers'
        first = func._schema.arguments[0] if func._schema.arguments else None
        self.bumps = (func._schema.name.startswith("aten::_foreach_") and first is not None
                      and str(first.type) == "List[Tensor]" and first.alias_info is not None
                      and first.alias_info.is_write)


_PLANS: dict[int, _Plan] = {}
#: what _fast answers for a call it leaves to the general path (None is an op's result: in-place foreach ops')
_GENERAL = object()


def _fast(plan: _Plan, args: tuple, kwargs: dict | None):
    """``_dispatch`` of a plain op whose keyword arguments, if any, are plain values; :data:`_GENERAL` to leave
    it to the general path.

    Anything unusual (tensors on two GPUs, or a CPU tensor alongside, a list holding anything but
    emulated tensors) goes the general way, which allows it or raises the device's error.
    """
    if kwargs:
        for v in kwargs.values():
            if type(v) not in _PLAIN_KWARG:
                return _GENERAL
    uargs = list(args)
    first = None
    n = len(args)
    listed = []  # the emulated tensors in Tensor[] arguments
    for i in plan.lists:
        if i >= n:
            break
        inner = []
        for a in args[i]:
            if not isinstance(a, MirageTensor):
                return _GENERAL
            if first is None:
                first = a
            elif a._gpu != first._gpu:
                return _GENERAL
            inner.append(a._elem)
        listed += args[i]
        uargs[i] = inner
    for i in plan.tensors:
        if i >= n:
            break
        a = args[i]
        if isinstance(a, MirageTensor):
            if first is None:
                first = a
            elif a._gpu != first._gpu:
                return _GENERAL
            uargs[i] = a._elem
        elif isinstance(a, torch.Tensor):
            if a.dim() > 0:  # 0-dim CPU tensors (and numbers) are scalars
                return _GENERAL
            if a.device.type == BACKEND:
                uargs[i] = _scalar_on_host(a)
    if first is None:
        return _GENERAL
    override = dev.allocation_override()
    gpu = first._gpu if override is None else override
    if RUNTIME.settings.estimate:
        if kwargs or listed:
            return _GENERAL  # its rules for tensors without values are the general path's
        out = (estimate.run_without_values(plan.run, plan.func, args, None, uargs, {}) if estimate.mixed(uargs)
               else plan.run(*uargs))
    else:
        out = plan.run(*uargs, **kwargs) if kwargs else plan.run(*uargs)
    if type(out) is not torch.Tensor:
        return _wrap(out, gpu, [a for a in args if isinstance(a, MirageTensor)] + listed, plan, args)
    for a in args:  # in-place ops (and lift_fresh) return their argument: hand back the same wrapper
        if isinstance(a, MirageTensor) and a._elem is out:
            return _same_wrapper(a, out, gpu)
    if out.is_conj() or out.is_neg():
        return _new(out.resolve_conj().resolve_neg(), gpu, None)  # see _wrap_one
    if plan.view and args[0] is first:
        src = first._src
        return _new(out, gpu, first if src is None else src)
    return _new(out, gpu, None)


def _dispatch(func, plan: _Plan, args, kwargs):
    """Run ``func`` on the CPU tensors inside the wrappers and wrap what it returns."""
    # Hand-written unwrap of the argument shapes aten uses (tensors, lists and tuples of them,
    # devices): pytree is ~2x slower.
    inputs: list[MirageTensor] = []
    cpus: list[torch.Tensor] = []
    uargs = _unwrap(args, inputs, cpus)
    ukwargs = dict(zip(kwargs, _unwrap(kwargs.values(), inputs, cpus))) if kwargs else {}
    gpu = inputs[0]._gpu if inputs else None
    if not plan.mixed_ok and gpu is not None:
        for w in inputs:
            if w._gpu != gpu:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"cuda:{gpu} and cuda:{w._gpu}!"
                )
        if cpus:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, cuda:{gpu} and cpu!"
            )
    if RUNTIME.device.sync_debug and inputs and _synchronizes(func, args, kwargs):
        dev.synchronizing()
    override = dev.allocation_override()
    out_gpu = override if override is not None else gpu if gpu is not None else RUNTIME.device.current
    if inputs and inputs[0]._elem.is_meta and (
            func in _SYNCING or (func is _aten.copy_.default and not uargs[0].is_meta)):
        return estimate.host_read(func, uargs)  # estimate mode: values read on the host, or shapes they decide
    kind = plan.kind
    if kind == _PLAIN or kind == _KERNEL:
        if RUNTIME.settings.estimate and estimate.mixed((*uargs, *ukwargs.values())):
            out = estimate.run_without_values(plan.run, func, args, kwargs, uargs, ukwargs)
        else:
            out = plan.run(*uargs, **ukwargs)
    elif kind != _TO and _tracing(inputs):
        # torch.compile traces (shim/compile/torch_compile.py): a random op or dropout is itself in the graph,
        # drawn as inductor draws; a collective names the GPU whose data it holds (shim/ops/functional.py)
        out = (traced_collective(func, uargs, ukwargs, out_gpu) if kind == _COLLECTIVE
               else plan.run(*uargs, **ukwargs))
    elif kind == _TO:
        target = args[1] if func is _aten.to.device else kwargs.get("device") if kwargs else None
        if target is not None and target.type == "cpu" and uargs[0].is_meta:  # estimate mode: no values
            dtype = ukwargs.get("dtype") or (uargs[2] if func is _aten.to.device else None) or uargs[0].dtype
            return estimate.placeholder(uargs[0].to(dtype), "a copy to the host (.cpu(), .to('cpu'))")
        if uargs[0].is_meta and target is not None:  # estimate mode: stays on the GPU, without values
            if func is _aten.to.device:
                uargs[1] = _META
            else:
                ukwargs["device"] = _META
        out = plan.run(*uargs, **ukwargs)
        if target is not None and target.type == "cpu":
            # leaves the GPU: a plain CPU tensor. aten.to itself arrives here inside another subclass's
            # dispatch (DTensor's RNG tracker moves its state to the host), and would return its host input
            return out.clone() if out is uargs[0] else out
    elif kind == _DROPOUT:
        out = rng.native_dropout(*uargs, out_gpu)
    elif kind == _DROPOUT_BACKWARD:
        out = _native_dropout_backward(*uargs, **ukwargs)
    elif kind == _COLLECTIVE:
        out = functional_collective(func, uargs, ukwargs, out_gpu)
    else:  # _RANDOM
        out = rng.call_random(func, tuple(uargs), ukwargs, out_gpu)
    return _wrap(out, out_gpu, inputs, plan, args)


_CPU = torch.device("cpu")
_META = torch.device("meta")


def _synchronizes(func, args, kwargs) -> bool:
    """Whether this call waits for the GPU on a GPU build (a value, a size or the data handed to the host)."""
    if func in _SYNCING:
        return func is not _aten.repeat_interleave.Tensor or not (kwargs or {}).get("output_size")
    non_blocking = (kwargs or {}).get("non_blocking", False)
    if func in _LEAVING_OPS:  # to the host, unless non_blocking
        target = args[1] if func is _aten.to.device else (kwargs or {}).get("device")
        return target is not None and target.type == "cpu" and not non_blocking
    if func is _aten.copy_.default:  # into a host tensor
        return not isinstance(args[0], MirageTensor) and not (args[2] if len(args) > 2 else non_blocking)
    if func is _aten.index.Tensor:  # a boolean mask's size is the number of its True elements
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _scalar_on_host(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor on the emulated device that is no wrapper, as the scalar it is, on the host.

    While dynamo propagates fake tensors, a number that C++ wraps as a tensor on its operand's device
    (``torch.where(cond, x, 7)``'s 7) is a fake tensor on ``mirage:0`` beside the wrappers' CPU insides.
    """
    return t.to(_CPU)


def _unwrap(items, inputs: list, cpus: list) -> list:
    """``items`` with every wrapper replaced by its CPU tensor; wrappers go to ``inputs``, CPU tensors to ``cpus``."""
    out = []
    for a in items:
        if isinstance(a, MirageTensor):
            inputs.append(a)
            a = a._elem
        elif isinstance(a, torch.Tensor):
            if a.dim() > 0:  # a 0-dim CPU tensor is a scalar, which any op takes alongside cuda ones
                cpus.append(a)
            elif a.device.type == BACKEND:
                a = _scalar_on_host(a)
        elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            a = type(a)(_unwrap(a, inputs, cpus))
        elif isinstance(a, torch.device) and a.type == BACKEND:
            a = _CPU
        out.append(a)
    return out


def _wrap(out, gpu: int, inputs: list, plan: _Plan, args):
    """Wrap an op's result (a tensor, or lists and tuples of them) on GPU ``gpu``."""
    src = None
    if plan.view and args and isinstance(args[0], MirageTensor):
        src = args[0]._src
        if src is None:  # the wrapper that holds the storage, so views never form a chain
            src = args[0]
    if isinstance(out, torch.Tensor):
        return _wrap_one(out, gpu, {id(w._elem): w for w in inputs}, src)
    if isinstance(out, (list, tuple)):
        return _wrap_all(out, gpu, {id(w._elem): w for w in inputs}, src)
    return out


def _wrap_all(out, gpu: int, inputs: dict, src):
    return type(out)([
        _wrap_one(o, gpu, inputs, src) if isinstance(o, torch.Tensor)
        else _wrap_all(o, gpu, inputs, src) if isinstance(o, (list, tuple))
        else o
        for o in out
    ])


def _wrap_one(o: torch.Tensor, gpu: int, inputs: dict, src) -> torch.Tensor:
    """Wrap ``o``; ``inputs`` maps the id of each argument's CPU tensor to its wrapper."""
    if isinstance(o, MirageTensor):
        return o
    w = inputs.get(id(o))
    if w is not None:  # in-place and out= ops return their argument: hand back the same wrapper
        return _same_wrapper(w, o, gpu)
    if o.is_conj() or o.is_neg():
        # The wrapper cannot carry the conjugate/negative bits of a lazy view (conj(),
        # _neg_view()), and kernels run on the CPU tensor would not see them: materialize
        # the view (it stops aliasing its base, as resolve_conj() does).
        return _new(o.resolve_conj().resolve_neg(), gpu, None)
    return _new(o, gpu, src)


def _same_wrapper(w: MirageTensor, o: torch.Tensor, gpu: int) -> MirageTensor:
    """The wrapper ``w`` of ``o``, which an in-place or out= op returned, with ``o``'s geometry."""
    if w.shape != o.shape or w.stride() != o.stride() or w.storage_offset() != o.storage_offset():
        # resize_, out= of another shape and in-place view ops (t_, squeeze_, as_strided_) changed
        # the CPU tensor's geometry; the wrapper keeps its own. Copy the new geometry onto the same
        # Python object (set_data), since callers, and C++ composites such as arange that return
        # their own out tensor, keep their reference to it.
        w.data = _new(o, gpu, None)
        RUNTIME.allocator.moved(w)  # a resize may have re-allocated the storage: the GPU's books follow
    return w


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided
#: the C++ wrapper factory (shim/tensor/fast_dispatch.py): the wrapper _make_wrapper_subclass makes of a plain
#: strided tensor, ``_elem`` set, without parsing a dozen keyword arguments per op; None where not built
_new_wrapper = None


def use_wrapper_factory(factory) -> None:
    """Make wrappers with ``factory(elem)`` (shim/tensor/fast_dispatch.py's, in C++), not ``_make_wrapper_subclass``."""
    global _new_wrapper
    _new_wrapper = factory


def _new(elem: torch.Tensor, gpu: int, src: MirageTensor | None) -> MirageTensor:
    """A wrapper of ``elem`` on GPU ``gpu``: counted through ``src`` (a view of its storage), else on its own."""
    if _new_wrapper is not None and type(elem) is torch.Tensor and elem.layout is _STRIDED:
        r = _new_wrapper(elem)  # (subclasses, e.g. a collective's AsyncCollectiveTensor, go the general way)
    else:
        offset = elem.storage_offset()
        if offset or elem.layout is not _STRIDED:
            r = _make_wrapper(MirageTensor, elem.size(), strides=elem.stride(), storage_offset=offset,
                              dtype=elem.dtype, layout=elem.layout, device=BACKEND_DEVICE)
        else:
            # most outputs: the defaults (offset 0, strided) left out, as each keyword costs its parsing
            r = _make_wrapper(MirageTensor, elem.size(), strides=elem.stride(), dtype=elem.dtype,
                              device=BACKEND_DEVICE)
        r._elem = elem
    r._gpu = gpu
    if type(elem) is not torch.Tensor and traced(elem):
        return r  # no memory of its own: what the compiled code allocates is counted once wrapped
    if src is None or src.requires_grad:
        # A view of a tensor in an autograd graph takes a hold of its own: keeping that tensor's wrapper
        # alive (_src) would close a cycle through C++ that Python's collector never sees, whenever the
        # view is saved in the tensor's own grad_fn. Non-reentrant activation checkpointing does that: its
        # recomputation packs each saved tensor as x.detach(), and relu, SDPA, ... save their output; the
        # recomputed activations then stayed counted for the rest of the run, some 19 GiB a step on
        # torchtitan's Llama 3 8B. The allocator counts the storage once however many wrappers hold it.
        r._mem = RUNTIME.allocator.hold(elem, gpu)
    else:
        r._src = src
    return r


class _Describing(threading.local):
    on = False  # while this thread's torch describes a tensor it makes a fake copy of (see untyped_storage)


_describing = _Describing()
_describe_tensor = meta_utils.MetaTensorDescriber.describe_tensor


def _describe_wrapper_storage(self, t, *, recurse=True, trace=False):
    """``MetaTensorDescriber.describe_tensor``, with a wrapper's own storage: its data's storage is the inner
    tensor's, which the fake copy describes (the same storage twice reads as aliasing, which fails)."""
    prev, _describing.on = _describing.on, True
    try:
        return _describe_tensor(self, t, recurse=recurse, trace=trace)
    finally:
        _describing.on = prev


def _tracing(args) -> bool:
    """Whether the first emulated tensor among ``args`` holds a tracer's stand-in (see :func:`traced`)."""
    for a in args:
        if isinstance(a, MirageTensor):
            return type(a._elem) is not torch.Tensor and traced(a._elem)
    return False


def traced(elem: torch.Tensor) -> bool:
    """Whether ``elem`` is a tracer's stand-in (fake, functional) rather than data: dynamo or AOTAutograd runs."""
    return isinstance(elem, FunctionalTensor) or is_fake(elem)


def _native_dropout_backward(grad_output: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward``: the CPU kernel's ``grad_output * mask * scale``, less one temporary."""
    return grad_output.mul(mask).mul_(scale)


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    if not RUNTIME.device.initialized:
        dev.initialize()  # every cuda tensor made from scratch starts in one of these two factories
    gpu = dev.allocation_device()
    nbytes = math.prod(size) * _itemsize(dtype)
    RUNTIME.allocator.check(gpu, nbytes)  # before the host allocates it
    elem = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format, device=_inside(nbytes))
    return MirageTensor(elem, gpu)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    if not RUNTIME.device.initialized:
        dev.initialize()
    gpu = dev.allocation_device()
    nbytes = 0
    if all(n > 0 for n in size):
        nbytes = (1 + sum((n - 1) * st for n, st in zip(size, stride))) * _itemsize(dtype)
        RUNTIME.allocator.check(gpu, nbytes)
    elem = torch.empty_strided(size, stride, dtype=dtype, layout=layout, device=_inside(nbytes))
    return MirageTensor(elem, gpu)


def _inside(nbytes: int) -> torch.device:
    """Where the data inside a new emulated tensor of ``nbytes`` lives: host memory; in estimate mode, nowhere
    (meta) past the size whose values it keeps (shim/tensor/estimate.py)."""
    return _META if RUNTIME.settings.estimate and nbytes > estimate.VALUES_MAX_BYTES else _CPU


def _itemsize(dtype) -> int:
    return (dtype or torch.get_default_dtype()).itemsize


def _copy_from(src, dst, non_blocking=False):
    # reached below the Python key: torch.tensor(data, device=...) excludes it while copying
    dst._elem.copy_(src._elem if isinstance(src, MirageTensor) else src)
    return dst


def _efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    # autograd's all-zero gradients (sgn's backward, forward-mode formulas): ordinary zeros
    # stand in for the ZeroTensor, which has no kernels for the backend
    where = _inside(math.prod(size) * _itemsize(dtype))
    return MirageTensor(torch.zeros(size, dtype=dtype, layout=layout, device=where), dev.allocation_device())


def _on_cuda_key(factory):
    """``factory`` for the CUDA dispatch key, which ``device="cuda:i"`` reaches when the mode is not there.

    The mode is per thread; threads it does not follow (the autograd engine's
    device thread, for a backward not started from Python, see shim/cuda/engine.py;
    user threads) reach C++ with the cuda device itself. The device's index
    names the emulated GPU.
    """

    def run(*args, device=None, **kwargs):
        gpu = RUNTIME.device.current if device is None or device.index is None else dev.check_index(device.index)
        with dev.allocating_on(gpu):
            return factory(*args, device=device, **kwargs)

    return run


def register_foreach() -> None:
    """Let optimizers and ``clip_grad_norm_`` pick the foreach kernels for ``cuda:i`` tensors.

    On a GPU build their default is ``foreach=True`` for CUDA tensors, but torch
    grants it only to the exact types ``torch.Tensor``/``Parameter``, so the
    wrapper would fall back to the per-parameter loop: a dozen ops per parameter
    through ``__torch_dispatch__`` instead of a dozen in all (about 1 ms of a
    transformer block's AdamW step; bench/dispatch_overhead.py).
    """
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if MirageTensor not in supported:
            supported.append(MirageTensor)


_lib: torch.library.Library | None = None


def register_factories() -> None:
    """Let C++ allocate on the backend device with no Python tensor in hand (DDP does)."""
    global _lib
    meta_utils.MetaTensorDescriber.describe_tensor = _describe_wrapper_storage
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    _lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _lib.impl("_efficientzerotensor", _efficient_zero_tensor, "PrivateUse1")
    _lib.impl("empty.memory_format", _on_cuda_key(_empty_memory_format), "CUDA")
    _lib.impl("empty_strided", _on_cuda_key(_empty_strided), "CUDA")
