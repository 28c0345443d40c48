"""GPU code a framework builds as it runs, refused in one line: DeepSpeed's CUDA/HIP ops.

DeepSpeed compiles its GPU ops on first use (``OpBuilder.load``: a prebuilt module, else
``jit_load`` with nvcc or hipcc against the GPU runtime's headers): its fused optimizers,
the inference kernels, DeepCompile's runtime (``"compile": {"deepcompile": true}``), ...
Under mirage its accelerator is ``cuda`` (as on a ROCm machine) but there is neither a
GPU runtime nor a GPU compiler, and a CPU build of torch has no ROCm home: the build
failed deep inside DeepSpeed (``CUDA_HOME`` is None: "expected str, bytes or
os.PathLike object, not NoneType"). Such code cannot run on emulated GPUs at all, so
each load of a ``CUDAOpBuilder`` op is refused before it starts, in one line naming
the op, its builder and, where a config setting asks for it, the setting.
"""

from __future__ import annotations

import sys
from types import MappingProxyType

from shim.import_hooks import after_import

MODULE = "deepspeed.ops.op_builder.builder"
MESSAGE = ("mirage: DeepSpeed's {name!r} op ({builder}) is code DeepSpeed builds with nvcc or hipcc for a GPU's own "
           "runtime, which emulated GPUs do not have: it cannot run under mirage{hint}")
#: the config setting that loads an op, where the op's name does not say it
_HINTS = MappingProxyType({
    "dc": ' (DeepCompile, "compile": {"deepcompile": true}: leave it out, and engine.compile() compiles with '
          "torch.compile, which works)",
})


def _refused(self, *args, **kwargs):
    """``CUDAOpBuilder.load`` / ``jit_load`` under mirage: the one-line refusal."""
    raise RuntimeError(MESSAGE.format(name=self.name, builder=type(self).__name__, hint=_HINTS.get(self.name, "")))


def _refuse_gpu_ops() -> None:
    builder = sys.modules[MODULE].CUDAOpBuilder
    builder.load = builder.jit_load = _refused


def install() -> None:
    """Refuse DeepSpeed's GPU ops once its op builders are imported."""
    after_import(MODULE, _refuse_gpu_ops)
