"""``cuda:i`` tensors: a wrapper subclass around a CPU tensor.

At the C++ level every emulated tensor sits on the one PrivateUse1 device
(``mirage:0``): the Python device guard reports a single device and the
autograd engine indexes its ready queues by device index. The emulated GPU
index lives on the wrapper (``_gpu``), and Python sees ``device`` as
``cuda:<_gpu>``. Every aten op on a wrapper reaches ``__torch_dispatch__``,
which runs it on the CPU tensors inside and wraps the results again.
"""

from __future__ import annotations

import torch

from shim import device as dev

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


class MirageTensor(torch.Tensor):
    """A tensor on emulated GPU ``_gpu``; its data is the CPU tensor ``_elem``."""

    _elem: torch.Tensor
    _gpu: int

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
        return r

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
        target = kwargs.get("device") if kwargs else None
        if func is _aten._to_copy.default and target is not None and target.type == "cpu":
            return func(*uargs, **ukwargs)  # leaves the GPU: a plain CPU tensor
        override = dev.allocation_override()
        out_gpu = override if override is not None else gpu if gpu is not None else dev.STATE.current
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
        return MirageTensor(o, gpu)
    if w.shape != o.shape:
        # A wrapper's sizes are fixed at creation. Factories fill an empty out tensor
        # (arange, linspace, ...) and use the returned one: hand back a fresh wrapper.
        # Resizing a tensor that holds data would leave the caller's reference stale.
        if w.numel() != 0:
            raise RuntimeError(
                f"mirage: resizing a cuda tensor that holds data in place ({w.shape} -> {o.shape}, "
                "e.g. resize_ or out= of another shape) is not supported yet; allocate the output "
                "with its final shape"
            )
        return MirageTensor(o, gpu)
    return w


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    elem = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format)
    return MirageTensor(elem, dev.allocation_device())


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    elem = torch.empty_strided(size, stride, dtype=dtype, layout=layout)
    return MirageTensor(elem, dev.allocation_device())


def _copy_from(src, dst, non_blocking=False):
    # reached below the Python key: torch.tensor(data, device=...) excludes it while copying
    dst._elem.copy_(src._elem if isinstance(src, MirageTensor) else src)
    return dst


_lib: torch.library.Library | None = None


def register_factories() -> None:
    """Let C++ allocate on the backend device with no Python tensor in hand (DDP does)."""
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    _lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
