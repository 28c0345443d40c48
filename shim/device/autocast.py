"""``torch.autocast("cuda")`` for tensors on the emulated GPUs.

Autocast is a dispatch key per backend: ``autocast("cuda")`` enables
AutocastCUDA, which never sees our tensors (their backend is PrivateUse1, and
torch registers no autocast kernels for it). So whenever cuda autocast is
switched on or off, the PrivateUse1 one follows, and the kernels registered
here apply CUDA's op lists (ATen's ``autocast_mode.h``, torch 2.13) with
CUDA's policies: lower-precision ops run in the autocast dtype, fp32 ops in
float32, "set dtype" ops get ``dtype=float32``, ``norm`` its float32
overload, promote ops the widest input type. Every other op falls through.
tests/test_fidelity.py checks the lists against the AutocastCUDA kernels of
the installed torch.
"""

from __future__ import annotations

import torch

from shim.device.state import BACKEND

# CUDA's lists, as (op, overload) names; a bare name is the default overload
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)
#: CUDA refuses these under autocast (they are unsafe in float16), with this advice
BANNED = ("binary_cross_entropy",)

_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(t) -> bool:
    # CUDA's rule: floating-point tensors on the autocast device, float64 left alone
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cuda"


def _cast(x, dtype: torch.dtype):
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def cast_lower(tensors: tuple) -> tuple:
    """``tensors`` as a lower-precision op sees them under cuda autocast (eligible ones in its dtype)."""
    return _cast(tensors, torch.get_autocast_dtype("cuda"))


def excluded():
    """A guard under which the backend's autocast kernels are skipped, as CUDA's do when they redispatch."""
    return torch._C._ExcludeDispatchKeyGuard(_EXCLUDE)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from (v for v in a if isinstance(v, torch.Tensor))
        elif isinstance(a, torch.Tensor):
            yield a


def _lower(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cuda")
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
    return kernel


def _set_opt_dtype(op):
    # softmax/log_softmax take dtype positionally (the dispatcher passes it so when given), the rest
    # keyword-only: set it where the schema puts it
    index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    positional = not op._schema.arguments[index].kwarg_only

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if _eligible(args[0] if args else None):
                if positional and len(args) > index:
                    if args[index] is None:
                        args = (*args[:index], torch.float32, *args[index + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
            return op(*args, **kwargs)
    return kernel


def _append_dtype(to_overload, to_args):
    """CUDA's fp32_append_dtype (``norm``): redispatch to the overload taking a dtype, float32 when eligible."""
    def kernel(*args):
        dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return to_overload(*to_args(*args), dtype=dtype)
    return kernel


def _norm_scalar(self, p=2):
    return self, p


def _norm_dim(self, p, dim, keepdim=False):
    return self, p, dim, keepdim


#: (op, the overload it redispatches to, how its arguments map onto that overload's)
APPEND_DTYPE = (
    ("norm.Scalar", "norm.ScalarOpt_dtype", _norm_scalar),
    ("norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype", _norm_dim),
)


def _promote(op):
    def kernel(*args, **kwargs):
        widest = None
        for t in _tensors(args, kwargs):
            if _eligible(t):
                widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if widest is None:
                return op(*args, **kwargs)
            return op(*_cast(args, widest), **{k: _cast(v, widest) for k, v in kwargs.items()})
    return kernel


def _banned(name):
    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"torch.nn.functional.{name} and torch.nn.BCELoss are unsafe to autocast.\n"
            "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
            "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
            "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
            "safe to autocast."
        )
    return kernel


def _overload(name: str):
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op)
    return getattr(packet, overload or "default")


_libs: list[torch.library.Library] = []


def _mirror(setter):
    """Wrap ``torch.set_autocast_enabled``/``set_autocast_dtype`` so cuda's setting also applies to our backend."""

    def wrapped(*args):
        setter(*args)
        if len(args) == 2 and args[0] == "cuda":
            setter(BACKEND, args[1])
        elif len(args) == 1:  # the deprecated one-argument form means cuda
            setter(BACKEND, args[0])
    return wrapped


def install() -> None:
    """Register the autocast kernels for the backend and tie its autocast state to cuda's."""
    register_kernels()
    torch.set_autocast_enabled = _mirror(torch.set_autocast_enabled)
    torch.set_autocast_dtype = _mirror(torch.set_autocast_dtype)


def register_kernels() -> None:
    """Register the autocast kernels for the backend (once per process).

    The fork server registers them before it forks (forkserver/preload.py): only the emulated tensors
    reach AutocastPrivateUse1, so a process that never activates the shim never runs them, and a rank
    that registered its own would write its private copy of ~20 MiB of the dispatcher's pages (and
    spend ~40 ms of CPU) for what every rank registers alike.
    """
    if _libs:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    _libs.extend((fallthrough, lib))
    for names, policy in ((LOWER_PRECISION_FP, _lower), (FP32, _fp32), (FP32_SET_OPT_DTYPE, _set_opt_dtype),
                          (PROMOTE, _promote)):
        for name in names:
            lib.impl(name, policy(_overload(name)), _KEY)
    for name, to_overload, to_args in APPEND_DTYPE:
        lib.impl(name, _append_dtype(_overload(to_overload), to_args), _KEY)
    for name in BANNED:
        lib.impl(name, _banned(name), _KEY)
