"""Triton kernels on the emulated GPUs: Triton's interpreter over the host memory behind the tensors.

A ROCm build ships ``triton`` and runs ``@triton.jit`` kernels on the GPU. An emulated GPU's memory is
host memory (a ``cuda`` tensor's data is the CPU tensor ``_elem``), so its kernels run on the host, in
Triton's own interpreter (``TRITON_INTERPRET=1``: each program of the grid runs in turn, with numpy,
over the tensors' memory). This module arranges that inside every rank, without the user setting
anything. It is a module of its own because it touches only Triton, never torch's dispatch: it is set
up before user code runs (``shim/bootstrap.py``) and configures Triton right after the program imports
it, costing nothing to a program that never does.

- ``@triton.jit`` picks the interpreter as it decorates (``triton.knobs.runtime.interpret``, read from
  ``TRITON_INTERPRET``), Triton's own helpers included (``tl.sum``'s combine function, decorated as
  ``import triton`` runs), so the variable is set when the rank starts, before any user import: kernels
  decorated before ``import torch`` are interpreted too. Torch reads it only where inductor generates
  Triton code; inductor generates C++ for the emulated device, so nothing else changes.
- ``triton.runtime.driver.active`` answers as the profile's GPU (``shim/device/state.py``): target
  ``hip``/``gfx950``, warp size 64, the CU count, LDS size, clocks and memory bandwidth of the profile,
  so libraries choose the code paths they choose on that GPU. (Triton's own HIP driver would look for
  ``libamdhip64.so`` and fail.)
- ``@triton.autotune``: the driver's benchmarker runs each config once and times it on the host, and
  the autotuner keeps the fastest, as on a GPU (once per key). Host time ranks configs by what the
  interpreter pays (fewer, larger programs win), which is what the rest of the run pays too; every
  config computes the same values.
- Zero copy: the interpreter copies each argument's whole storage to the host and back around every
  launch; an emulated tensor's data already is on the host, so the kernel gets ``_elem`` itself.
- What Triton 3.7's interpreter lacks and a GPU has: ``triton.language.extra.libdevice`` (the device
  math library, e.g. Liger's ``rsqrt`` and ``tanh``) is a set of stubs it cannot call, so the functions
  the AMD backend provides get numpy implementations (fp32/fp64, as on the GPU); a Python float
  argument is an fp32 scalar inside the kernel, as compiled Triton passes it.
- Speed: ``triton.language`` is patched for the interpreter once per launch, not at every helper call.
- Clocked mode: each launch is a kernel on the emulated timeline, priced by what its programs loaded,
  stored and multiplied (shim/clock/triton_kernels.py); the autotuner's benchmarking runs are not.
- ``torch.compile``: a launch is a graph break and runs with dynamo off (dynamo traces compiled kernels,
  not the interpreter).
- A construct the interpreter cannot run (``tl.inline_asm_elementwise``, an extern library call, a
  libdevice function without a host implementation) fails at launch with one line naming the kernel,
  where it is, and the construct (:class:`UnsupportedTritonKernel`), never wrong numbers.
"""

from __future__ import annotations

import os
import sys
import time
from types import MappingProxyType

from shim.clock import triton_kernels
from shim.compile import triton_libdevice
from shim.import_hooks import after_import
from shim.rank.runtime import RUNTIME

#: the variable Triton's knobs read (``triton.knobs.runtime.interpret``)
INTERPRET = "TRITON_INTERPRET"


class UnsupportedTritonKernel(RuntimeError):
    """A Triton kernel uses a construct that the interpreter behind the emulated GPUs cannot run."""


def prepare() -> None:
    """Before user code: kernels decorated from now on are interpreted; Triton is set up once imported."""
    os.environ[INTERPRET] = "1"
    after_import("triton", _configure)
    after_import("torch._dynamo", _run_outside_dynamo)


def _run_outside_dynamo() -> None:
    """``torch.compile`` runs a Triton kernel it meets eagerly, in the interpreter: a graph break.

    Dynamo knows compiled kernels (``JITFunction``), not the interpreter's, and tracing the interpreter's
    Python fails. So Triton's files and this module are skipped (by path, without importing Triton), and
    each launch runs with dynamo off (``torch._dynamo.disable``): otherwise the frames a launch calls (the
    grid function, the kernel's programs, the shim's ``TorchFunctionMode`` on every tensor attribute the
    interpreter reads) would be compiled one by one. Done once both Triton and dynamo are imported.
    """
    once = RUNTIME.once
    if "torch._dynamo" not in sys.modules or "triton-configured" not in once.done:
        return
    if not once.first("triton-outside-dynamo"):
        return
    import torch._dynamo
    from torch._dynamo import trace_rules
    from triton.runtime import autotuner, interpreter

    trace_rules.add("triton")
    trace_rules.add(__name__)
    # an @triton.autotune'd kernel is an Autotuner whatever it wraps, and dynamo takes every Autotuner
    # for a compiled kernel (TritonKernelVariable, which then fails on the interpreter's function):
    # one over the interpreter is a function dynamo does not trace, as a jit'd kernel is
    from torch._dynamo.variables import builder, functions

    kernel_variable = builder.TritonKernelVariable

    def triton_kernel_variable(kernel, *args, **kwargs):
        if isinstance(getattr(kernel, "fn", None), interpreter.InterpretedFunction):
            return functions.SkipFunctionVariable(kernel, reason="a Triton kernel in Triton's interpreter",
                                                  source=kwargs.get("source"))
        return kernel_variable(kernel, *args, **kwargs)

    builder.TritonKernelVariable = triton_kernel_variable
    for cls in (interpreter.InterpretedFunction, autotuner.Autotuner, autotuner.Heuristics):
        cls.run = torch._dynamo.disable(cls.run, reason="a Triton kernel runs in Triton's interpreter on the "
                                                         "emulated GPU, outside the graph")


def _configure() -> None:
    """Point Triton at the emulated GPU: the driver, zero-copy launches, errors, libdevice."""
    if not RUNTIME.once.first("triton-configured"):
        return
    try:
        from triton.runtime import interpreter
        from triton.runtime.driver import driver
    except ImportError:  # a Triton too old or too new for what follows: leave it as it is
        return
    ours = _driver_class()()
    driver.set_active(ours)
    if hasattr(driver, "_default"):
        driver._default = ours  # reset_active() comes back here, never to Triton's HIP driver
    _patch_grid_executor(interpreter.GridExecutor)
    _patch_scalar_args(interpreter)
    _patch_lang_once(interpreter)
    triton_libdevice.patch()
    if RUNTIME.settings.clocked:
        triton_kernels.install(interpreter)
    _run_outside_dynamo()  # where dynamo was imported first


# ------------------------------------------------------------------------------------------------
# the driver: what triton.runtime.driver.active answers
# ------------------------------------------------------------------------------------------------


def _profile():
    from shim.device import state  # noqa: F401 - it registers the device state on the runtime

    return RUNTIME.device.profile


class _DeviceUtils:
    """``driver.active.utils``: the device properties Triton's HIP driver reads from ``hipDeviceProp_t``."""

    #: HBM stacks of an Instinct GPU: 8 x 1024-bit
    MEM_BUS_WIDTH = 8192

    def get_device_properties(self, device: int = 0) -> dict:
        p = _profile()
        # the memory clock that gives the profile's bandwidth as Triton computes it (testing.get_dram_gbps:
        # 2 * clock_khz * bus_width / 8 / 1e6 GB/s)
        mem_clock_khz = round(p.hbm_tbps * 1e12 / (2 * self.MEM_BUS_WIDTH / 8) / 1e3)
        return {
            "max_shared_mem": p.lds_per_cu_kib * 1024,
            "max_num_regs": 65536,
            "multiprocessor_count": p.compute_units,
            "sm_clock_rate": p.clock_mhz * 1000,
            "mem_clock_rate": mem_clock_khz,
            "mem_bus_width": self.MEM_BUS_WIDTH,
            "arch": p.gcn_arch_name,
            "warpSize": p.wavefront,
            "max_threads_per_sm": 2048,
            "cooperativeLaunch": 1,
        }

    def load_binary(self, *args, **kwargs):
        raise UnsupportedTritonKernel("mirage: the emulated GPU runs Triton kernels in Triton's interpreter; "
                                      "it cannot load a compiled GPU binary")


def _host_benchmarker(kernel_call, warmup=None, rep=None, grad_to_none=None, quantiles=None,
                      return_mode="mean", **kwargs):
    """The autotuner's benchmarker: one run, timed on the host (ms); the same figure for each quantile.

    The run is the host choosing a config, not the program's work: clocked mode leaves it unpriced."""
    start = time.perf_counter()
    with triton_kernels.unpriced():
        kernel_call()
    ms = (time.perf_counter() - start) * 1e3
    if quantiles is not None:
        return [ms for _ in quantiles]
    return ms


_DRIVER = None


def _driver_class():
    """The driver class (built on first use: its base class is Triton's)."""
    global _DRIVER
    if _DRIVER is not None:
        return _DRIVER
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class EmulatedHIPDriver(DriverBase):
        """Triton's active driver on the emulated GPUs: a HIP target with the profile's figures."""

        def __init__(self):
            super().__init__()
            self.utils = _DeviceUtils()

        @staticmethod
        def is_active():
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            from triton.backends.amd.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_current_target(self):
            p = _profile()
            return GPUTarget("hip", p.gfx, p.wavefront)

        def get_device_interface(self):
            import torch

            return torch.cuda

        def get_current_device(self) -> int:
            import torch

            return torch.cuda.current_device()

        def set_current_device(self, device) -> None:
            import torch

            torch.cuda.set_device(device)

        def get_current_stream(self, device=None) -> int:
            return 0  # kernels run when launched: every stream is the null stream to Triton

        def get_device_capability(self, device=None):
            import torch

            return torch.cuda.get_device_capability(device)

        def get_active_torch_device(self):
            import torch

            return torch.device("cuda", self.get_current_device())

        def get_benchmarker(self):
            return _host_benchmarker

        def get_empty_cache_for_benchmark(self):
            # triton.testing.do_bench zeroes this between runs to flush the GPU's L2; the host has
            # nothing to flush, so a small buffer keeps do_bench cheap
            import torch

            return torch.empty(1024, dtype=torch.int, device="cuda")

        def clear_cache(self, cache) -> None:
            cache.zero_()

    _DRIVER = EmulatedHIPDriver
    return _DRIVER


# ------------------------------------------------------------------------------------------------
# launches: the emulated tensors' own host memory, and one-line errors
# ------------------------------------------------------------------------------------------------


def _host_view(arg):
    """The tensor the interpreter should address for ``arg``: an emulated tensor's CPU data itself."""
    tensor_mod = sys.modules.get("shim.tensor.wrapper")
    if tensor_mod is None:  # no emulated tensor exists before the shim is active
        return arg
    from triton.runtime.jit import TensorWrapper
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(arg, tensor_mod.MirageTensor):
        elem = arg._elem
        return elem if type(elem) is _torch_tensor() else arg  # a subclass inside: the interpreter's copies
    if isinstance(arg, TensorWrapper):  # triton.reinterpret(t, dtype)
        base = _host_view(arg.base)
        return arg if base is arg.base else TensorWrapper(base, arg.dtype)
    if isinstance(arg, tuple):
        from triton._utils import _tuple_create

        return _tuple_create(arg, map(_host_view, arg))
    if isinstance(arg, TensorDescriptor):
        base = _host_view(arg.base)
        if base is arg.base:
            return arg
        return TensorDescriptor(base, arg.shape, arg.strides, arg.block_shape, arg.padding, arg.round_f32_to_tf32)
    return arg


def _torch_tensor():
    return sys.modules["torch"].Tensor


def _is_host(arg) -> bool:
    """Whether the interpreter can address ``arg``'s memory as it is (a plain CPU tensor, or holds only such)."""
    if isinstance(arg, tuple):
        return all(_is_host(a) for a in arg)
    if not hasattr(arg, "data_ptr"):
        return not hasattr(arg, "base")  # a TensorDescriptor: by its base
    base = getattr(arg, "base", arg)  # TensorWrapper
    return type(base) is _torch_tensor() and base.device.type == "cpu"


def _patch_grid_executor(grid_executor) -> None:
    init_args = grid_executor._init_args_hst
    restore_args = grid_executor._restore_args_dev
    call = grid_executor.__call__

    def _init_args_hst(self, args_dev, kwargs):
        # emulated tensors (and plain CPU tensors) are addressed in place; anything else is copied
        # to the host and back as the interpreter does it
        args = [_host_view(a) for a in args_dev]
        kw = {k: _host_view(v) for k, v in kwargs.items()}
        self._mirage_in_place = [_is_host(a) for a in args], {k: _is_host(v) for k, v in kw.items()}
        copied_args, copied_kw = init_args(self, [None if h else a for a, h in zip(args, self._mirage_in_place[0])],
                                           {k: None if self._mirage_in_place[1][k] else v for k, v in kw.items()})
        args_hst = [a if h else c for a, c, h in zip(args, copied_args, self._mirage_in_place[0])]
        kwargs_hst = {k: v if self._mirage_in_place[1][k] else copied_kw[k] for k, v in kw.items()}
        return args_hst, kwargs_hst

    def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        in_args, in_kw = self._mirage_in_place
        restore_args(self, [None if h else a for a, h in zip(args_dev, in_args)],
                     [None if h else a for a, h in zip(args_hst, in_args)],
                     {k: v for k, v in kwargs.items() if not in_kw.get(k)},
                     {k: v for k, v in kwargs_hst.items() if not in_kw.get(k)})

    def __call__(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        except Exception as e:
            unsupported = _unsupported_construct(e)
            if unsupported is None:
                raise
            raise UnsupportedTritonKernel(_unsupported_message(self.fn, e, unsupported)) from None

    grid_executor._init_args_hst = _init_args_hst
    grid_executor._restore_args_dev = _restore_args_dev
    grid_executor.__call__ = __call__


def _patch_scalar_args(interpreter) -> None:
    """A Python float argument is an fp32 scalar inside the kernel, as compiled Triton passes it.

    Triton 3.7's interpreter leaves it a Python float: ``eps.to(tl.float32)`` (Liger's norms) raises, and
    ``x * scale`` keeps a bf16 ``x``'s type where the GPU computes in fp32.
    """
    convert = interpreter._implicit_cvt

    def _implicit_cvt(arg):
        if type(arg) is float:
            import numpy as np
            import triton.language as tl

            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = _implicit_cvt


def _patch_lang_once(interpreter) -> None:
    """Patch ``triton.language`` for the interpreter once per launch, not at every nested call.

    The interpreter redirects ``tl``'s builtins to itself around a launch (``_patch_lang``: an
    ``inspect.getmembers`` of the language modules), and again at every call of a ``@triton.jit``
    helper inside the kernel — ``tl.sum``/``tl.max`` call their combine function per program — which
    was half the time of a softmax. Inside a launch, a call whose language modules are already
    patched skips it; the launch's restore ends it, as before.
    """
    import triton.language as tl

    patch_lang = interpreter._patch_lang
    languages = (tl, tl.core)
    patched: set[int] = set()

    class _Restore:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            try:
                self.scope.restore()
            finally:
                patched.clear()

    class _Nothing:
        @staticmethod
        def restore():
            pass

    modules_of: dict = {}  # fn -> the language modules its globals hold (what _patch_lang patches)

    def _patch_lang(fn):
        mods = modules_of.get(fn)
        if mods is None:
            mods = modules_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in languages))
        if patched and mods and mods <= patched:
            return _Nothing
        scope = patch_lang(fn)
        patched.update(mods)
        return _Restore(scope)

    interpreter._patch_lang = _patch_lang

    # and the numpy type of a Triton type, which the interpreter looks up with a fresh dict at every op
    np_dtype = interpreter._get_np_dtype
    np_dtypes: dict = {}

    def _get_np_dtype(tt_dtype):
        try:
            return np_dtypes[tt_dtype]
        except KeyError:
            found = np_dtypes[tt_dtype] = np_dtype(tt_dtype)
            return found
        except TypeError:  # unhashable
            return np_dtype(tt_dtype)

    interpreter._get_np_dtype = _get_np_dtype


#: what the interpreter's builder raises (NotImplementedError) -> the construct, in the kernel's words
_CONSTRUCTS = MappingProxyType({
    "inline_asm": "tl.inline_asm_elementwise (inline assembly)",
    "extern_elementwise": "tl.extern_elementwise (a call into an external device library)",
})


def _unsupported_construct(error: BaseException) -> str | None:
    """The construct an interpreter failure names, or None for any other failure (a bug in the kernel)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, triton_libdevice.NoHostLibdevice):
            return str(error)
        if isinstance(error, ValueError) and "Did you forget to add @triton.jit" in str(error):
            # a builtin of a module the interpreter does not redirect to itself (an @core.extern library)
            tb = error.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            fn = tb.tb_frame.f_locals.get("fn") if tb is not None else None
            name = f"{fn.__module__}.{fn.__qualname__}" if callable(fn) else "a Triton builtin"
            return f"{name} (a builtin the interpreter does not provide, such as an external device library's)"
        if isinstance(error, NotImplementedError):
            text = str(error)
            for key, construct in _CONSTRUCTS.items():
                if key in text:
                    return construct
            return text or "an operation Triton's interpreter does not implement"
        error = error.__cause__ or error.__context__
    return None


def _unsupported_message(fn, error: BaseException, construct: str) -> str:
    """One line: which kernel, where in it, what, and why."""
    code = getattr(fn, "__code__", None)
    where = ""
    if code is not None:
        line = code.co_firstlineno
        tb, seen = None, set()
        e = error
        while e is not None and id(e) not in seen:  # the innermost frame in the kernel's own file
            seen.add(id(e))
            tb = e.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == code.co_filename:
                    line = tb.tb_lineno
                tb = tb.tb_next
            e = e.__cause__ or e.__context__
        where = f" ({os.path.basename(code.co_filename)}:{line})"
    name = getattr(fn, "__name__", "?")
    return (f"mirage: Triton kernel '{name}'{where} uses {construct}, which the emulated GPU cannot run: "
            f"its Triton kernels run in Triton's interpreter on the host")
