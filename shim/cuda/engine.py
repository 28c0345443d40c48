"""How torch's C++ runtime treats the backend device: its device guard, and where backward runs.

Two costs per training step that are not in any op's kernel (measured on
bench/dispatch_inprocess.py's transformer block; docs/performance.md, "Dispatch
overhead, session 4"):

- **The device guard.** torch.utils.backend_registration registers a Python
  device guard, which torch's C++ asks for its device type on every guard
  call (about 400 per transformer-block step: autograd asks for a stream per
  output it records, every DeviceGuard sets and restores the device).
  :func:`install` registers ``shim/native/device_guard.cpp`` in its place, which
  answers the same in C++. Without a C++ compiler the Python guard stays
  (:data:`GUARD_ERROR` says why); nothing else changes. The same guard
  answers for the CUDA device type, which a CPU build has none for: autograd
  asks it when it records a tensor C++ sees on cuda (a FakeTensor made with
  ``device=t.device`` while tracing: flex attention's backward), which would
  otherwise abort the process.
- **The device thread.** The autograd engine runs a GPU's backward on a
  thread of its own per device; the calling thread waits. Here every kernel
  is a CPU kernel, so that hand-off only costs: a thread switch in and out
  of each backward, the GIL and the graph's thread-local state (the Python
  mode stack) handed across per node, and backward kernels running on another
  core than the forward that produced their inputs. ``backward()`` and
  ``autograd.grad()`` therefore run the graph on the calling thread, as they
  do for CPU tensors (the engine's own switch, ``set_multithreading_enabled``).
  Hooks then run on the thread that called ``backward()``; the order of the
  graph's nodes is the engine's either way.
"""

from __future__ import annotations

import ctypes

import torch

from shim.native import build as native_build

#: None once the C++ device guard is PrivateUse1's; otherwise why not (one line)
GUARD_ERROR: str | None = "shim.cuda.engine.install() has not run"

_guard_lib: ctypes.CDLL | None = None  # kept: torch holds a pointer into it for the process's life


def install() -> None:
    """Register the C++ device guard and run backward on the calling thread.

    Must run before ``_setup_privateuseone_for_python_backend``, whose Python
    guard torch would otherwise keep (the first registered is kept).
    """
    _install_guard()
    _install_inline_backward()


def _install_guard() -> None:
    global GUARD_ERROR, _guard_lib
    try:
        _guard_lib = native_build.load(native_build.GUARD_SOURCE, "the device guard")
    except native_build.BuildError as e:
        GUARD_ERROR = str(e)
    else:
        GUARD_ERROR = None if _guard_lib.mirage_register_device_guard() else "another device guard came first"
        # tensors C++ sees on cuda (FakeTensors made while tracing) need a guard when autograd records
        # them; without it that aborts the process (device_guard.cpp). A CUDA build keeps its own.
        _guard_lib.mirage_register_cuda_guard()
        # the profiler's CUDA event timing (device_guard.cpp), which a CPU build leaves failing
        _guard_lib.mirage_register_profiler_stubs()


def _install_inline_backward() -> None:
    # wraps whatever is there (shim/device/deferred.py wraps it too, before or after: the order is immaterial)
    run = torch.autograd.graph._engine_run_backward
    enabled, set_enabled = torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled

    def engine_run_backward(*args, **kwargs):
        # The switch is the calling thread's (the graph task keeps it for its nodes); a nested
        # backward (a reentrant checkpoint's) finds it off already and leaves it so.
        if not enabled():
            return run(*args, **kwargs)
        set_enabled(False)
        try:
            return run(*args, **kwargs)
        finally:
            set_enabled(True)

    torch.autograd.graph._engine_run_backward = engine_run_backward
    torch.autograd._engine_run_backward = engine_run_backward
