"""``torch.compile`` on the emulated GPUs: every backend runs the program eagerly, with one notice.

Real compilation is out of reach here: dynamo cannot trace the emulation (the
wrapper subclass has no ``__tensor_flatten__``, and the cuda and backend device
modules share their stream functions, which dynamo refuses to register twice),
and inductor would generate Triton/HIP kernels for a real GPU. So
``torch.compile`` in any form — ``torch.compile(model)``, ``@torch.compile``
with or without arguments, ``Module.compile()``, any backend, ``fullgraph``,
``dynamic``, ``mode``, ``options`` — returns the function or module itself,
which computes what the compiled one would. The first call that asks for a
backend other than ``eager``/``aot_eager`` (which only run the same ops
eagerly anyway) prints one line to stderr saying so, once per process.
docs/device.md ("torch.compile") has the details.
"""

from __future__ import annotations

import sys

import torch

#: backends that run the captured graph's ops eagerly: running the function as it is gives the same results
EAGER_BACKENDS = ("eager", "aot_eager")
NOTICE = ("mirage: torch.compile(backend={name!r}) runs eagerly on the emulated GPUs (same results, no "
          "compilation: dynamo cannot trace the emulated tensors); this notice is printed once")

_noticed = False


def _backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


def compile(model=None, *, fullgraph: bool = False, dynamic=None, backend="inductor", mode=None,  # noqa: A001
            options=None, disable: bool = False):  # torch.compile's signature: fullgraph/dynamic change nothing here
    """``torch.compile``: ``model`` itself (it runs eagerly), or a decorator returning the function it decorates."""
    global _noticed
    if mode is not None and options is not None:  # as torch.compile
        raise RuntimeError("Either mode or options can be specified, but both can't be specified at the same time.")
    name = _backend_name(backend)
    if not disable and not _noticed and name not in EAGER_BACKENDS:
        _noticed = True
        print(NOTICE.format(name=name), file=sys.stderr, flush=True)
    if model is None:  # used as @torch.compile(...)
        return lambda fn: fn
    return model


def install() -> None:
    """Replace ``torch.compile`` (``nn.Module.compile`` calls it too) and let ``torch._dynamo.reset()`` run."""
    torch.compile = compile
    if not hasattr(torch._C, "_cuda_CUDAAllocator_AllocatorState"):
        # torch._dynamo.reset() imports torch._inductor.cudagraph_trees when cuda is available, which
        # imports this CUDA-build class when torch.backends.cuda.is_built() (True here); it is only a
        # type there, for CUDA graphs that never run on the emulated GPUs
        torch._C._cuda_CUDAAllocator_AllocatorState = type("_cuda_CUDAAllocator_AllocatorState", (), {})
