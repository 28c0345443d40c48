"""libdevice on the emulated GPUs: host implementations of the AMD backend's device math for Triton's interpreter.

Triton 3.7's interpreter has only stubs for ``triton.language.extra.libdevice`` (the functions a GPU's
device library provides, e.g. Liger's ``rsqrt`` and ``tanh``); :func:`patch` gives those the AMD backend
has numpy implementations (fp32/fp64, as on the GPU), and makes every other one fail naming itself.
"""

from __future__ import annotations

import math


class NoHostLibdevice(NotImplementedError):
    """A device function the host has no implementation of (raised at launch, named in the launch's error)."""


def _round_half_away(x):
    import numpy as np

    return np.copysign(np.floor(np.abs(x) + 0.5), x)


def _ilogb(x):
    import numpy as np

    return np.frexp(x)[1] - 1


def _libdevice_table() -> dict:
    """libdevice name -> (numpy function, result kind): 'same' (the argument's float type) or 'i32'/'i64'."""
    import numpy as np

    erf = np.vectorize(math.erf, otypes=[np.float64])
    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    lgamma = np.vectorize(math.lgamma, otypes=[np.float64])
    same = {
        "abs": np.abs, "floor": np.floor, "ceil": np.ceil, "trunc": np.trunc, "rint": np.rint,
        "nearbyint": np.rint, "round": _round_half_away,
        "exp": np.exp, "exp2": np.exp2, "fast_expf": np.exp, "expm1": np.expm1,
        "log": np.log, "log2": np.log2, "log10": np.log10, "log1p": np.log1p,
        "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
        "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan,
        "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh, "fast_tanhf": np.tanh,
        "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh,
        "erf": erf, "erfc": erfc, "lgamma": lgamma,
        "atan2": np.arctan2, "pow": np.power, "hypot": np.hypot, "fmod": np.fmod, "copysign": np.copysign,
        "nextafter": np.nextafter, "fast_dividef": np.divide, "ldexp": lambda x, e: np.ldexp(x, np.asarray(e, np.int32)),
        "fma": lambda a, b, c: np.asarray(a, np.float64) * b + c,
    }
    table = {name: (fn, "same") for name, fn in same.items()}
    for name, fn in {"isnan": np.isnan, "isinf": np.isinf, "signbit": np.signbit, "finitef": np.isfinite,
                     "isfinited": np.isfinite, "ilogb": _ilogb}.items():
        table[name] = (fn, "i32")
    table["llrint"] = (np.rint, "i64")
    return table


def _libdevice_function(name: str, fn, kind: str):
    def call(*args, _semantic=None, **kwargs):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        tensors = [a for a in args if isinstance(a, tl.tensor)]
        if not tensors:
            raise NoHostLibdevice(f"libdevice.{name} on Python numbers")
        scalar = tensors[0].dtype
        floats = {tl.float32: np.float32, tl.float64: np.float64}
        if scalar not in floats and not (name == "abs" and scalar.is_int()):
            # the AMD backend's libdevice has fp32/fp64 overloads only: the GPU refuses these too
            raise NoHostLibdevice(f"libdevice.{name} on {scalar} (the device library takes fp32 and fp64)")
        np_type = floats.get(scalar)
        data = [a.handle.data if isinstance(a, tl.tensor) else (np_type(a) if np_type else a) for a in args]
        with np.errstate(all="ignore"):
            out = np.asarray(fn(*data))
        if kind == "same":
            out, out_ty = out.astype(np_type or data[0].dtype, copy=False), scalar
        else:
            out_ty = tl.int32 if kind == "i32" else tl.int64
            out = out.astype(np.int32 if kind == "i32" else np.int64)
        shapes = [a.type.get_block_shapes() for a in tensors if a.type.is_block()]
        if shapes:
            shape = list(np.broadcast_shapes(*shapes))
            out = np.broadcast_to(out, shape).copy() if list(out.shape) != shape else out
            return tl.tensor(TensorHandle(out, out_ty), tl.block_type(out_ty, shape))
        return tl.tensor(TensorHandle(out.reshape(1) if out.ndim == 0 else out, out_ty), out_ty)

    call.__name__ = call.__qualname__ = name
    call.__module__ = "triton.language.extra.libdevice"  # Triton's dependency scan skips these
    return call


def _libdevice_missing(name: str, why: str):
    def call(*args, **kwargs):
        raise NoHostLibdevice(f"{name} ({why})")

    call.__name__ = call.__qualname__ = name.rsplit(".", 1)[-1]
    call.__module__ = "triton.language.extra.libdevice"
    return call


def patch() -> None:
    """Give the device math libraries host implementations, before any kernel module imports them.

    ``triton.language.extra.libdevice`` (stubs the backend resolves when compiling) and the AMD backend's
    own ``triton.language.extra.hip.libdevice`` get numpy implementations of the functions the AMD backend
    has; a function without one fails naming itself. NVIDIA's ``triton.language.extra.cuda.libdevice`` fails
    as it would on an AMD GPU, which has no such library.
    """
    import importlib

    table = _libdevice_table()
    for module_name, short in (("triton.language.extra.libdevice", "libdevice"),
                               ("triton.language.extra.hip.libdevice", "hip.libdevice"),
                               ("triton.language.extra.cuda.libdevice", "cuda.libdevice")):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, fn in list(vars(module).items()):
            if name.startswith("_") or not callable(fn) or getattr(fn, "__module__", "") != module_name:
                continue
            if short == "cuda.libdevice":
                setattr(module, name, _libdevice_missing(f"{module_name}.{name}", "NVIDIA's device library, "
                                                         "which an AMD GPU does not have"))
            elif name in table:
                setattr(module, name, _libdevice_function(name, *table[name]))
            else:
                setattr(module, name, _libdevice_missing(f"{short}.{name}", "no host implementation of this "
                                                         "device function"))
