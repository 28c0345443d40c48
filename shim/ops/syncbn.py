"""The CUDA-only batch-norm kernels ``nn.SyncBatchNorm`` calls, written for the host.

``SyncBatchNorm`` computes per-rank statistics (``batch_norm_stats``), all-gathers
them, combines them (``batch_norm_gather_stats_with_counts``) and normalizes
(``batch_norm_elemt``); its backward reduces (``batch_norm_backward_reduce``),
all-reduces and applies (``batch_norm_backward_elemt``). torch ships these for
CUDA only, and an emulated tensor's data is a CPU tensor, so they are
registered here for the CPU key, following the CUDA kernels' arithmetic
(statistics of half-precision inputs kept in float32).
"""

from __future__ import annotations

import torch

_lib: torch.library.Library | None = None


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``like`` (channels on dim 1)."""
    return v.view((1, -1) + (1,) * (like.dim() - 2))


def _reduce_dims(t: torch.Tensor) -> list[int]:
    return [d for d in range(t.dim()) if d != 1]


def batch_norm_stats(input, eps):
    x = input.to(_acc(input))
    var, mean = torch.var_mean(x, dim=_reduce_dims(x), unbiased=False)
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    counts = counts.to(mean.dtype).view(-1, 1)
    total = counts.sum()
    g_mean = (counts * mean).sum(0) / total
    var_i = invstd.pow(-2) - eps
    var = (counts * (var_i + (mean - g_mean).pow(2))).sum(0) / total
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * total / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return g_mean, (var + eps).rsqrt()


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    y = (input.to(mean.dtype) - _channel(mean, input)) * _channel(invstd, input)
    if weight is not None:
        y = y * _channel(weight.to(mean.dtype), input)
    if bias is not None:
        y = y + _channel(bias.to(mean.dtype), input)
    return y.to(input.dtype)


def batch_norm_elemt_out(input, weight, bias, mean, invstd, eps, *, out):
    return out.copy_(batch_norm_elemt(input, weight, bias, mean, invstd, eps))


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    dy = grad_out.to(mean.dtype)
    dims = _reduce_dims(dy)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (input.to(mean.dtype) - _channel(mean, input))).sum(dims)
    empty = mean.new_empty(0)
    grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight_g and weight is not None else empty
    grad_bias = sum_dy.to(weight.dtype if weight is not None else mean.dtype) if bias_g else empty
    if not input_g:
        sum_dy, sum_dy_xmu = empty, empty
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    total = count.to(mean.dtype).sum()
    x_mu = input.to(mean.dtype) - _channel(mean, input)
    scale = _channel(invstd, input)
    g = grad_out.to(mean.dtype) - _channel(sum_dy / total, input) - x_mu * scale.pow(2) * _channel(sum_dy_xmu / total, input)
    g = g * scale
    if weight is not None:
        g = g * _channel(weight.to(mean.dtype), input)
    return g.to(input.dtype)


def install() -> None:
    """Register the kernels for the CPU key (the data of every emulated tensor)."""
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("batch_norm_stats", batch_norm_stats, "CPU")
    _lib.impl("batch_norm_gather_stats_with_counts", batch_norm_gather_stats_with_counts, "CPU")
    _lib.impl("batch_norm_elemt", batch_norm_elemt, "CPU")
    _lib.impl("batch_norm_elemt.out", batch_norm_elemt_out, "CPU")
    _lib.impl("batch_norm_backward_reduce", batch_norm_backward_reduce, "CPU")
    _lib.impl("batch_norm_backward_elemt", batch_norm_backward_elemt, "CPU")
