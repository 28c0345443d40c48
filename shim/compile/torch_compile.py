"""``torch.compile`` on the emulated GPUs: dynamo captures, AOTAutograd desugars, inductor compiles for the host.

An emulated GPU's memory is host memory, so a compiled graph runs on the host,
over the CPU tensors inside the emulated ones:

- ``MirageTensor`` is a traceable wrapper subclass (``__tensor_flatten__`` in
  shim/tensor/wrapper.py). Dynamo captures graphs over it as over any tensor (its fake
  copies keep the inner tensor on the CPU), AOTAutograd traces its
  ``__torch_dispatch__`` and hands the backend forward and backward graphs over
  the inner CPU tensors, and inductor generates C++ kernels for them, as for any
  CPU graph. Outputs come back wrapped on the inputs' GPU; every backend
  (inductor, ``aot_eager``, ``eager``, a user's) works this way.
- Inside a compiled region, ``CudaMode`` (shim/cuda/mode.py), which dynamo inlines
  into every torch call, hands the calls that name ``cuda`` to :func:`factory`,
  :func:`move` and :func:`to`: the tensor is made on the host and put on the GPU
  with :func:`on_gpu`, a node of the graph that AOTAutograd traces through
  (nothing of it is left at run time).
- Dynamo must not compile the shim's own frames: after a graph break the rest of
  a function runs eagerly with dynamo's frame callback set, and every op on an
  emulated tensor calls ``__torch_dispatch__``. The shim's modules are in
  dynamo's skip list, but for this one and shim/cuda/mode.py, which it inlines. This
  happens when ``torch._dynamo`` is first imported (it costs a second, so not
  before a program compiles).

``MIRAGE_COMPILE=eager`` keeps the old behaviour on request: ``torch.compile``
in any form returns the function or module itself, which runs eagerly, and says
so once on stderr. docs/device.md ("torch.compile") has the details.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor

from shim.clock import compiled as compiled_clock
from shim.import_hooks import after_import
from shim.ops.higher_order import on_host_now
from shim.rank.runtime import RUNTIME
from shim.tensor.wrapper import BACKEND, MirageTensor, _new

#: the environment variable that keeps ``torch.compile`` eager (its one value, ``eager``)
ENV = "MIRAGE_COMPILE"
NOTICE = ("mirage: torch.compile(backend={name!r}) runs eagerly on the emulated GPUs ({env}=eager: same "
          "results, nothing compiled); this notice is printed once")
#: the shim's modules dynamo inlines (the rest it skips): this one, and those that say so (:func:`inline`),
#: with whether dynamo may also compile their functions as frames of their own
_inlined = {__name__: False}

_graph_break = None  # torch._dynamo.graph_break, once dynamo is imported


def _backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


def eager_compile(model=None, *, fullgraph: bool = False, dynamic=None, backend="inductor", mode=None,
                  options=None, disable: bool = False):
    """``torch.compile`` under ``MIRAGE_COMPILE=eager``: ``model`` itself, or a decorator returning its function."""
    if mode is not None and options is not None:  # as torch.compile
        raise RuntimeError("Either mode or options can be specified, but both can't be specified at the same time.")
    name = _backend_name(backend)
    if not disable and name not in ("eager", "aot_eager") and RUNTIME.once.first("compile-eager-notice"):
        print(NOTICE.format(name=name, env=ENV), file=sys.stderr, flush=True)
    if model is None:  # used as @torch.compile(...)
        return lambda fn: fn
    return model


def on_gpu(t: torch.Tensor, gpu: int) -> torch.Tensor:
    """The host tensor ``t``, made inside a compiled region, as the ``cuda:gpu`` tensor it stands for.

    A node of dynamo's graph (``allow_in_graph``); AOTAutograd traces through it,
    so the compiled code makes ``t`` on the host and the output is wrapped, as
    every output is.
    """
    if isinstance(t, MirageTensor):  # a *_like factory of an emulated tensor is one already
        return t
    if on_host_now():  # in a score or mask function run on the host tensors: one of them
        return t
    return _new(t, gpu, None)


def gpu_of(d) -> int | None:
    """The emulated GPU a device argument names, or None if it is not cuda (shim/cuda/mode.py's rule, inlinable)."""
    if isinstance(d, bool):
        return None
    if isinstance(d, str):
        if not d.startswith(("cuda", BACKEND)):
            return None
        d = torch.device(d)
    # torch.cuda.current_device(): dynamo folds it, guarded; DeviceState.current it would not trace
    if isinstance(d, int):
        index = d
    elif isinstance(d, torch.device) and d.type == "cuda":
        index = torch.cuda.current_device() if d.index is None else d.index
    elif isinstance(d, torch.device) and d.type == BACKEND:
        index = d.index if d.index else torch.cuda.current_device()  # C++ names every emulated GPU mirage:0
    else:
        return None
    if not 0 <= index < len(RUNTIME.device.physical):
        _graph_break()  # run eagerly, where the runtime's "invalid device ordinal" is raised
    return index


def factory(func, args, kwargs: dict, gpu: int):
    """``func(*args, device=cuda:gpu)`` in a compiled region: made on the host, put on the GPU."""
    return on_gpu(func(*args, **dict(kwargs, device="cpu")), gpu)


def move(t: torch.Tensor, gpu: int, dtype=None, copy: bool = False, memory_format=None):
    """``t.to(cuda:gpu, dtype)`` / ``t.cuda(gpu)`` in a compiled region."""
    layout = {} if memory_format is None else {"memory_format": memory_format}
    if t.device.type == "cuda":
        if t.device.index != gpu:
            _graph_break()  # a copy between two emulated GPUs runs eagerly
        if copy or layout or (dtype is not None and dtype != t.dtype):
            return t.to(dtype=dtype or t.dtype, copy=copy, **layout)
        return t
    if t.requires_grad:
        _graph_break()  # a differentiable host-to-GPU copy runs eagerly (on_gpu would cut the graph)
    return on_gpu(t.to(dtype=dtype or t.dtype, copy=True, **layout), gpu)


def to(args: tuple, kwargs: dict):
    """``Tensor.to(...)`` in a compiled region: a move when it names a cuda device, else torch's own."""
    t, rest = args[0], args[1:]
    device = kwargs.get("device")
    dtype = kwargs.get("dtype")
    copy = kwargs.get("copy", False)
    for a in rest:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):  # t.to(other): other's device and dtype
            device, dtype = a.device, a.dtype
        elif isinstance(a, (str, int, torch.device)) and not isinstance(a, bool):
            device = a
    gpu = gpu_of(device) if device is not None else None
    if gpu is None:
        return torch.Tensor.to(*args, **kwargs)
    if len(rest) > 2 and isinstance(rest[-1], bool) and isinstance(rest[-2], bool):
        copy = rest[-1]  # (..., non_blocking, copy) given positionally
    return move(t, gpu, dtype, copy, kwargs.get("memory_format"))


def inline(module_name: str, *, frames: bool) -> None:
    """Let dynamo inline the shim module ``module_name``: shim/cuda/mode.py into every torch call it traces (not
    ``frames``: CudaMode's method, called eagerly between compiled graphs, would be compiled for the op it
    first saw and misanswer others), shim/comm/c10d_patches.py's DDP forward (``frames``: what
    ``torch.compile(DDP(model))`` starts compiling from)."""
    _inlined[module_name] = frames


def _cache_dir(shim_sources: list[Path]) -> str:
    """Inductor's cache directory for this shim: its keys hash the graph dynamo captured, not how the shim
    traces it (the collectives of shim/ops/functional.py), so another shim's compiled code must not be found."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    digest = hashlib.sha256()
    for f in shim_sources:
        digest.update(f.read_bytes())
    return os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir(),
                        f"mirage-{digest.hexdigest()[:16]}")


def _wrapping_fake_outputs(run_node):
    """DDPOptimizer's ``SubmodCompiler.run_node``, handing the next bucket's graph its inputs on the GPU.

    It compiles the graph one bucket at a time, and makes the next bucket's
    example inputs by calling the compiled bucket once on fake tensors; AOTAutograd
    answers that first call with its graph's outputs as traced, the inner host
    tensors, which the next bucket would take for host tensors. They are the
    GPU's (of the bucket's first emulated input), as every output of the bucket.
    """

    def wrapped(self, n):
        out = run_node(self, n)
        if n.op != "call_module":
            return out
        args, _ = self.fetch_args_kwargs_from_env(n)
        gpu = next((a._gpu for a in args if isinstance(a, MirageTensor)), None)
        if gpu is None:
            return out

        def on_gpu_fake(t):
            if type(t) is not FakeTensor:
                return t
            # with its requires_grad: else the next bucket's backward computes no gradient for its input,
            # and the buckets before it get none from the later ones
            return _new(t.detach(), gpu, None).requires_grad_(t.requires_grad)

        return type(out)(on_gpu_fake(t) for t in out) if isinstance(out, (list, tuple)) else on_gpu_fake(out)

    return wrapped


def _tell_daemon(compiling: bool) -> None:
    """Tell the daemons that this rank compiles (or no longer does): its peers' waits for it meanwhile are
    no hang (emulator/hang.py). Before a world forms there is nothing to wait on, and nothing is told."""
    import torch.distributed as dist

    if not RUNTIME.settings.has_daemon or not dist.is_available() or not dist.is_initialized():
        return
    from wire.schema import CompileState

    msg = CompileState(rank=dist.get_rank(), pid=os.getpid(), compiling=compiling)
    head, host = RUNTIME.client(), RUNTIME.host_client()
    for daemon in (head,) if host is None or host is head else (head, host):
        try:
            daemon.request(msg, timeout_s=5.0)
        except Exception:  # noqa: BLE001 - a daemon gone: the run is ending, and its collectives will say so
            return


def _outside_cuda_mode(compile_graph):
    """AOTAutograd's compilation (``AotAutograd.__call__``, inductor's and ``aot_eager``'s), whose compiled
    functions run with ``CudaMode`` off the stack while it is all there is on it.

    What dynamo traced of the mode is in the graph already, and the graph runs over the host tensors
    inside the emulated ones: at run time the mode would only see (and pass on, at ~1.5 us each) the
    dozens of torch calls AOTAutograd's wrappers and inductor's code make: a tensor's attributes,
    ``set_grad_enabled``, the profiler's ranges, extern kernels (docs/device.md, "The mode's cost").
    A backend that runs dynamo's graph itself (``eager``, a user's callable) keeps the mode: its graph
    calls torch on the emulated tensors, and a higher-order op's body there needs ``cuda`` translated.
    """

    def compile_with_aot(self, gm, example_inputs, **kwargs):
        compiled = compile_graph(self, gm, example_inputs, **kwargs)

        @functools.wraps(compiled)
        def run(*args):
            mode = RUNTIME.cuda.mode
            if torch._C._len_torch_function_stack() != 1 or torch._C._get_function_stack_at(0) is not mode:
                return compiled(*args)  # the mode already off (inside its own call), or a user's mode on it
            torch._C._pop_torch_function_stack()
            try:
                return compiled(*args)
            finally:
                torch._C._push_on_torch_function_stack(mode)

        return run

    return compile_with_aot


def _prepare_aot() -> None:
    """Run AOTAutograd's compiled functions outside the mode (:func:`_outside_cuda_mode`)."""
    from torch._dynamo.backends.common import AotAutograd

    AotAutograd.__call__ = _outside_cuda_mode(AotAutograd.__call__)


def _codes(module) -> list:
    """The code objects of ``module``'s functions and methods, and of the functions nested in them."""
    found = []
    stack = [f.__code__ for obj in vars(module).values()
             for f in ([obj] if inspect.isfunction(obj) else vars(obj).values() if inspect.isclass(obj) else ())
             if inspect.isfunction(f) and f.__module__ == module.__name__]
    while stack:
        code = stack.pop()
        found.append(code)
        stack.extend(c for c in code.co_consts if inspect.iscode(c))
    return found


def _storages_inside(get_tensor_storages):
    """Dynamo's ``get_tensor_storages``, which checks that a higher-order op's functions (``while_loop``'s
    body, say) alias none of their inputs, and refuses a wrapper subclass: an emulated tensor's storage is
    the host tensor's inside it."""

    def storages(tensor):
        return get_tensor_storages(tensor._elem if isinstance(tensor, MirageTensor) else tensor)

    return storages


def _prepare_dynamo() -> None:
    """Skip the shim's frames in dynamo, but those it inlines, let :func:`on_gpu` into its graphs, and keep
    inductor's cache of this shim's compiled code apart."""
    global _graph_break
    import torch._dynamo
    from torch._dynamo import trace_rules
    from torch._dynamo.eval_frame import skip_code

    sources = sorted(Path(__file__).resolve().parents[1].rglob("*.py"))  # every module of the shim
    inlined = {Path(sys.modules[name].__file__).resolve() for name in _inlined}
    for f in sources:
        if f not in inlined:
            trace_rules.SKIP_DIRS.append(trace_rules._as_posix_path(str(f)))
    trace_rules._recompile_re()
    for name, frames in _inlined.items():
        if frames:
            continue
        for code in _codes(sys.modules[name]):
            # inlined, never compiled as frames of their own: called eagerly between compiled graphs,
            # CudaMode.__torch_function__ would be compiled for the op it first saw and misanswer others
            skip_code(code)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache_dir(sources)
    if RUNTIME.settings.clocked:
        compiled_clock.install()
    torch._dynamo.callback_handler.register_start_callback(lambda _args: _tell_daemon(compiling=True))
    torch._dynamo.callback_handler.register_end_callback(lambda _args: _tell_daemon(compiling=False))
    from torch._dynamo.backends.distributed import SubmodCompiler

    SubmodCompiler.run_node = _wrapping_fake_outputs(SubmodCompiler.run_node)
    # once it is imported: importing it here, while torch._inductor may be importing dynamo, is circular
    after_import("torch._dynamo.backends.common", _prepare_aot)
    torch._dynamo.allow_in_graph(on_gpu)
    hops = sys.modules["torch._dynamo.variables.higher_order_ops"]
    hops.get_tensor_storages = _storages_inside(hops.get_tensor_storages)
    _graph_break = torch._dynamo.graph_break


def install() -> None:
    """Prepare dynamo when it is imported, or make ``torch.compile`` eager under ``MIRAGE_COMPILE=eager``."""
    if not hasattr(torch._C, "_cuda_CUDAAllocator_AllocatorState"):
        # torch._dynamo.reset() imports torch._inductor.cudagraph_trees when cuda is available, which
        # imports this CUDA-build class when torch.backends.cuda.is_built() (True here); it is only a
        # type there, for CUDA graphs that never run on the emulated GPUs
        torch._C._cuda_CUDAAllocator_AllocatorState = type("_cuda_CUDAAllocator_AllocatorState", (), {})
    if not hasattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled"):
        # what inductor asks before CUDA graphs (mode="reduce-overhead", "max-autotune"), which it then
        # skips for a graph over host tensors, as for any CPU graph
        torch._C._cuda_cudaCachingAllocator_is_enabled = lambda: True
    setting = RUNTIME.settings.compile
    if setting == "eager":
        torch.compile = eager_compile  # nn.Module.compile calls it too
        return
    if setting:
        sys.exit(f"mirage: {ENV}={setting!r} is not a compile setting: use {ENV}=eager to run torch.compile "
                 "eagerly, or leave it unset to compile")
    after_import("torch._dynamo", _prepare_dynamo)
