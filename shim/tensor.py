"""``cuda:i`` tensors: a wrapper subclass around a CPU tensor.

At the C++ level every emulated tensor sits on the one PrivateUse1 device
(``mirage:0``): the Python device guard reports a single device and the
autograd engine indexes its ready queues by device index. The emulated GPU
index lives on the wrapper (``_gpu``), and Python sees ``device`` as
``cuda:<_gpu>``. Every aten op on a wrapper reaches ``__torch_dispatch__``,
which runs it on the CPU tensors inside and wraps the results again.
"""

from __future__ import annotations

import math

import torch

from shim import device as dev
from shim import attention, deferred, rng
from shim.memory import ALLOCATOR

BACKEND = dev.BACKEND  # must be registered before this module is imported
BACKEND_DEVICE = torch.device(BACKEND, 0)

_aten = torch.ops.aten
# ops that legitimately take CPU tensors alongside cuda ones
_MIXED_OK = {
    _aten.copy_.default,
    _aten._to_copy.default,
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
    _aten.index_put.default,
    _aten.lift_fresh.default,
}


#: ops that copy a tensor to another device (``cpu``: off the emulated GPU)
_LEAVING_OPS = {_aten._to_copy.default, _aten.to.dtype_layout, _aten.to.device}


class _CudaStorage(torch.UntypedStorage):
    """A ``cuda:i`` tensor's storage as Python sees it: the host storage inside, on GPU ``i``."""

    _gpu: int

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._gpu)


class MirageTensor(torch.Tensor):
    """A tensor on emulated GPU ``_gpu``; its data is the CPU tensor ``_elem``."""

    _elem: torch.Tensor
    _gpu: int
    _mem: int = 0  # the allocator's key for _elem's storage (0: not counted)

    @staticmethod
    def __new__(cls, elem: torch.Tensor, gpu: int):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=BACKEND_DEVICE,
            requires_grad=False,
        )
        r._elem = elem
        r._gpu = gpu
        r._mem = ALLOCATOR.hold(elem, gpu)
        return r

    def __del__(self):
        # the last wrapper of a storage frees it on its GPU (torch.cuda.memory_allocated drops)
        if self._mem:
            ALLOCATOR.release(self._mem)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._gpu)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self._gpu

    def __repr__(self, *, tensor_contents=None) -> str:
        # format the CPU data; torch then appends device='cuda:i' and grad_fn as usual
        if tensor_contents is None:
            tensor_contents = torch._tensor_str._tensor_str(self._elem.detach(), len("tensor("))
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        return text.replace(f"{type(self).__name__}(", "tensor(", 1)

    def tolist(self):
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
        s = self._elem.untyped_storage()
        if type(s) is not _CudaStorage:
            s.__class__ = _CudaStorage  # torch keeps one Python object per storage: this sticks
        s._gpu = self._gpu
        return s

    def data_ptr(self) -> int:  # type: ignore[override]
        """The data's address (nonzero, shared by views), as code that compares storages expects."""
        return self._elem.data_ptr()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def __reduce_ex__(self, proto):
        # checkpoints of cuda tensors load back as CPU tensors on a CPU build
        return self._elem.clone().__reduce_ex__(proto)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return _dispatch(func, args, kwargs)
        except Exception as e:
            if not deferred.in_backward():
                raise
            # On the autograd engine's device thread an exception here aborts the process
            # (torch's Python device guard calls back into Python while it unwinds), so it
            # is handed to the thread that called backward() instead: see shim/deferred.py.
            return deferred.defer(e, func, args, kwargs)


def _dispatch(func, args, kwargs):
    """Run ``func`` on the CPU tensors inside the wrappers and wrap what it returns."""
    # Hand-written unwrap/wrap of the argument shapes aten uses (tensors, lists and
    # tuples of them, devices): every op comes through here, and pytree is ~2x slower.
    un = _Unwrap(func)
    uargs = tuple(un(a) for a in args)
    ukwargs = {k: un(v) for k, v in kwargs.items()} if kwargs else {}
    gpu = un.gpu
    if un.cpu_seen is not None and gpu is not None and func not in _MIXED_OK:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, cuda:{gpu} and cpu!"
        )
    target = args[1] if func is _aten.to.device else kwargs.get("device") if kwargs else None
    if target is not None and target.type == "cpu" and func in _LEAVING_OPS:
        # leaves the GPU: a plain CPU tensor. aten.to itself arrives here inside another subclass's
        # dispatch (DTensor's RNG tracker moves its state to the host), and would return its host input
        out = func(*uargs, **ukwargs)
        return out.clone() if out is uargs[0] else out
    override = dev.allocation_override()
    out_gpu = override if override is not None else gpu if gpu is not None else dev.STATE.current
    if func is _aten.native_dropout.default:
        return _wrap(rng.native_dropout(*uargs, out_gpu), out_gpu, un.wrappers)
    if func.namespace.startswith("_c10d_functional"):  # DTensor's collectives reach the "nccl" group
        from shim.backend import functional_collective

        return _wrap(functional_collective(func, uargs, ukwargs, out_gpu), out_gpu, un.wrappers)
    kernel = attention.CPU_KERNELS.get(func)  # GPU-only ops, computed on the CPU reference path
    if kernel is not None:
        return _wrap(kernel(*uargs, **ukwargs), out_gpu, un.wrappers)
    if rng.GENERATOR_ARG.get(func, 0) != rng.NO_GENERATOR:  # a random op, or one not seen yet
        return _wrap(rng.call_random(func, uargs, ukwargs, out_gpu), out_gpu, un.wrappers)
    return _wrap(func(*uargs, **ukwargs), out_gpu, un.wrappers)


_CPU = torch.device("cpu")


class _Unwrap:
    """Replaces wrappers by their CPU tensors, noting their GPU and which wrapper each came from."""

    __slots__ = ("func", "gpu", "wrappers", "cpu_seen")

    def __init__(self, func):
        self.func = func
        self.gpu: int | None = None
        self.wrappers: dict[int, MirageTensor] = {}
        self.cpu_seen: torch.Tensor | None = None

    def __call__(self, a):
        if isinstance(a, MirageTensor):
            if self.gpu is None:
                self.gpu = a._gpu
            elif a._gpu != self.gpu and self.func not in _MIXED_OK:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"cuda:{self.gpu} and cuda:{a._gpu}!"
                )
            self.wrappers[id(a._elem)] = a
            return a._elem
        if isinstance(a, torch.Tensor):
            if a.dim() > 0:
                self.cpu_seen = a
            return a
        if isinstance(a, (list, tuple)):
            return type(a)([self(x) for x in a]) if not isinstance(a, torch.Size) else a
        if isinstance(a, torch.device) and a.type == BACKEND:
            return _CPU
        return a


def _wrap(out, gpu: int, wrappers: dict[int, MirageTensor]):
    if isinstance(out, torch.Tensor):
        return _wrap_one(out, gpu, wrappers)
    if isinstance(out, (list, tuple)):
        return type(out)([_wrap(o, gpu, wrappers) for o in out])
    return out


def _wrap_one(o: torch.Tensor, gpu: int, wrappers: dict[int, MirageTensor]) -> torch.Tensor:
    if isinstance(o, MirageTensor):
        return o
    # in-place and out= ops return their argument: hand back the same wrapper
    w = wrappers.get(id(o))
    if w is None:
        if o.is_conj() or o.is_neg():
            # The wrapper cannot carry the conjugate/negative bits of a lazy view (conj(),
            # _neg_view()), and kernels run on the CPU tensor would not see them: materialize
            # the view (it stops aliasing its base, as resolve_conj() does).
            o = o.resolve_conj().resolve_neg()
        return MirageTensor(o, gpu)
    if w.shape != o.shape or w.stride() != o.stride() or w.storage_offset() != o.storage_offset():
        # resize_, out= of another shape and in-place view ops (t_, squeeze_, as_strided_) changed
        # the CPU tensor's geometry; the wrapper keeps its own. Copy the new geometry onto the same
        # Python object (set_data), since callers, and C++ composites such as arange that return
        # their own out tensor, keep their reference to it.
        w.data = MirageTensor(o, gpu)
        ALLOCATOR.moved(w)  # a resize may have re-allocated the storage: the GPU's books follow
    return w


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    if not dev.STATE.initialized:
        dev.initialize()  # every cuda tensor made from scratch starts in one of these two factories
    gpu = dev.allocation_device()
    ALLOCATOR.check(gpu, math.prod(size) * _itemsize(dtype))  # before the host allocates it
    elem = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format)
    return MirageTensor(elem, gpu)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    if not dev.STATE.initialized:
        dev.initialize()
    gpu = dev.allocation_device()
    if all(n > 0 for n in size):
        extent = 1 + sum((n - 1) * st for n, st in zip(size, stride))
        ALLOCATOR.check(gpu, extent * _itemsize(dtype))
    elem = torch.empty_strided(size, stride, dtype=dtype, layout=layout)
    return MirageTensor(elem, gpu)


def _itemsize(dtype) -> int:
    return (dtype or torch.get_default_dtype()).itemsize


def _copy_from(src, dst, non_blocking=False):
    # reached below the Python key: torch.tensor(data, device=...) excludes it while copying
    dst._elem.copy_(src._elem if isinstance(src, MirageTensor) else src)
    return dst


def _efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    # autograd's all-zero gradients (sgn's backward, forward-mode formulas): ordinary zeros
    # stand in for the ZeroTensor, which has no kernels for the backend
    return MirageTensor(torch.zeros(size, dtype=dtype, layout=layout), dev.allocation_device())


def _on_cuda_key(factory):
    """``factory`` for the CUDA dispatch key, which ``device="cuda:i"`` reaches when the mode is not there.

    The mode is per thread; threads it does not follow (the autograd engine's
    device thread running backward hooks, user threads) reach C++ with the
    cuda device itself. The device's index names the emulated GPU.
    """

    def run(*args, device=None, **kwargs):
        gpu = dev.STATE.current if device is None or device.index is None else dev.check_index(device.index)
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
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    _lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _lib.impl("_efficientzerotensor", _efficient_zero_tensor, "PrivateUse1")
    _lib.impl("empty.memory_format", _on_cuda_key(_empty_memory_format), "CUDA")
    _lib.impl("empty_strided", _on_cuda_key(_empty_strided), "CUDA")
