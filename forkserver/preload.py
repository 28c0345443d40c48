"""What the fork server imports before it forks any rank, and which variables those imports read.

A forked rank is only the process its command line asks for if these modules
loaded as they would have in it: :func:`import_time_env` names the variables
that must then agree between the server and the rank (``forkserver.server.refusal``).
"""

from __future__ import annotations

import _collections_abc as _abc
import gc
import importlib
import importlib.util
import os
import pkgutil
import sys

from forkserver.protocol import SERVER_ENV

#: what ranks import and a fresh interpreter would spend its start-up on (torch alone: ~1.5 s of CPU): the
#: shim's imports (Triton where installed: torch's FLOP counter imports it), what the first op on an emulated
#: tensor imports (torch.distributed.tensor, for any tensor subclass) and torch.optim's torch._dynamo
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.optim", "torch._dynamo", "torch.utils.flop_counter",
           "torch.utils.module_tracker", "zmq", "statistics", "sysconfig", "shlex", "tomllib",
           # mirage's wire library: what rank and daemon say (its dataclasses cost the most to build);
           # plain definitions, no state of a rank
           *(f"wire.{m}" for m in ("messages", "codec", "schema", "arena", "profiles", "collective_cost",
                                   "collective_timing", "kernels", "kineto_trace", "faults", "procfs", "endpoints")))
#: variables that the interpreter and the native libraries under torch read as they load (C's getenv,
#: which the server cannot watch); those read from Python while the modules load are recorded (:func:`preload`)
_NATIVE_READS = ("PYTHON", "KMP_", "GOMP_", "OPENBLAS_", "MKL_", "LD_", "MALLOC_")
#: among those, the ones read later, or applied to the rank after it forked (program.become)
_READ_LATER = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "MKL_NUM_THREADS",
               # read as dynamo loads only to place its precompile cache (DynamoCache, off unless asked for);
               # inductor reads it when it compiles. The shim sets it in every rank (Lightning's children
               # inherit it), so comparing it would refuse every process a rank starts
               "TORCHINDUCTOR_CACHE_DIR")
#: where a walk of the whole environment reads each variable (os.environ.copy(), .items(): 3.11 freezes both)
_WALKERS = frozenset({os.__file__, _abc.__file__, "<frozen os>", "<frozen _collections_abc>"})
#: the variables the preloaded modules read from os.environ while they loaded (filled by preload)
READ_FROM_PYTHON: set[str] = set()
#: the server's environment as the preloaded modules found it, and what they added to it themselves
#: (torch._inductor's cache_dir() writes its default into TORCHINDUCTOR_CACHE_DIR)
_BEFORE: dict[str, str] = {}
#: the top-level packages the preload brought in (torch, numpy, triton, sympy, wire, ...): the shim's hooks on
#: them wait for the program's own first import of each (shim.import_hooks.wait_for_program)
LOADED: set[str] = set()
_SET_BY_IMPORT: dict[str, str] = {}


def env_mismatch(env: dict[str, str]) -> str | None:
    """The first variable the preloaded modules (or the interpreter) read while they loaded whose value in
    ``env`` is not the one they saw; None if a rank with ``env`` would have loaded them the same way."""
    native = {k for k in env.keys() | _BEFORE.keys() if k.startswith(_NATIVE_READS) and not k.startswith(_READ_LATER)}
    for k in sorted((native | READ_FROM_PYTHON) - set(_READ_LATER)):
        theirs = env.get(k)
        if k == SERVER_ENV or theirs == _BEFORE.get(k):
            continue
        if k in _SET_BY_IMPORT and theirs in (None, _SET_BY_IMPORT[k]):
            continue  # the modules set it so, here or in the process that passed it on
        return k
    return None


def preload() -> None:
    """Import what every rank imports, once, before any rank is forked."""
    _BEFORE.update(os.environ)
    there = {name.partition(".")[0] for name in sys.modules}
    # as the shim sets it in every rank before Triton loads (shim.compile.triton_runtime.prepare): the
    # @triton.jit functions of Triton's own library are then the interpreter's
    os.environ["TRITON_INTERPRET"] = "1"
    environ = type(os.environ)
    saved = {name: environ.__dict__.get(name) for name in ("__getitem__", "get", "__contains__")}
    getitem = environ.__getitem__
    # what the shim's own code reads as it loads (its settings, the visible devices) each rank reads again
    # when its runtime is rebuilt (forkserver.program), so it need not agree with the server's
    spec = importlib.util.find_spec("shim")
    shim_dir = os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else "\0"

    def record(key, reader) -> None:
        if not reader.f_code.co_filename.startswith(shim_dir):
            READ_FROM_PYTHON.add(key)

    def get(self, key, default=None):
        record(key, sys._getframe(1))
        try:
            return getitem(self, key)
        except KeyError:
            return default

    def contains(self, key):
        record(key, sys._getframe(1))
        try:
            getitem(self, key)
        except KeyError:
            return False
        return True

    def item(self, key):  # os.environ[KEY]; not a copy or walk of the whole environment (os.environ.copy())
        reader = sys._getframe(1)
        if reader.f_code.co_filename not in _WALKERS:
            record(key, reader)
        return getitem(self, key)

    environ.__getitem__, environ.get, environ.__contains__ = item, get, contains  # os.getenv calls get
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError as e:  # a rank that needs it imports it itself (and fails as it would)
                print(f"forkserver: not preloaded: {name}: {e}", file=sys.stderr)
        _preload_shim()
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(environ, name)
            else:
                setattr(environ, name, value)
    READ_FROM_PYTHON.discard("TRITON_INTERPRET")  # set above, as the shim sets it in every rank
    LOADED.update({name.partition(".")[0] for name in sys.modules} - there)
    _SET_BY_IMPORT.update({k: v for k, v in os.environ.items() if k not in _BEFORE})
    gc.collect()
    gc.freeze()


def _preload_shim() -> None:
    """Import every module of the shim (not activate it): a rank's activation then only installs, which
    halves its CPU, and the modules' memory is shared. Many of them name the emulated device at import,
    which needs PrivateUse1 renamed first; the rename is the same in every rank of the session, and a
    process that never activates the shim (torchrun's agent) never uses the device. The autocast kernels
    are registered here too: only the device's tensors reach them. Each rank rebuilds the shim's runtime
    from its own settings (forkserver.program)."""
    try:
        import torch

        import shim
        from shim.device.state import BACKEND

        torch.utils.rename_privateuse1_backend(BACKEND)
        for info in pkgutil.walk_packages(shim.__path__, "shim."):
            if not info.name.startswith("shim.boot"):  # sitecustomize: what a session's process runs first
                importlib.import_module(info.name)
        from shim.device import autocast

        # kernels of a dispatch key only the emulated tensors reach, the same in every rank: registered in
        # each, they were a third of a forked rank's private memory (docs/scaling.md)
        autocast.register_kernels()
    except Exception as e:  # noqa: BLE001 - each rank imports what is missing itself, and fails as it would
        print(f"forkserver: the shim is not preloaded: {type(e).__name__}: {e}", file=sys.stderr)
