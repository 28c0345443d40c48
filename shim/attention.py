"""``scaled_dot_product_attention`` on the emulated GPUs reaches the fused ops a GPU build uses.

On a ROCm GPU, SDPA picks flash attention (fp16/bf16, no mask) or memory-
efficient attention (also fp32, takes a mask) before the math fallback, and
the rest of torch is written against those ops: DTensor has sharding rules
for ``_scaled_dot_product_flash_attention`` and
``_scaled_dot_product_efficient_attention`` (and their backwards), not for
the math decomposition. So :func:`route` makes the same choice (honouring
``torch.backends.cuda.*_sdp_enabled`` and ``sdpa_kernel``), and the CPU
kernels below compute those ops on the reference CPU path.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
_MAX_FLASH_HEAD_DIM = 256


def _fused_ok(q, k, v, attn_mask, dropout_p, enable_gqa) -> bool:
    # dropout needs the GPU's philox stream, which the CPU kernels cannot reproduce: math path then
    return (
        q.device.type == "cuda" and dropout_p == 0.0 and not enable_gqa and q.dim() == 4
        and q.dtype == k.dtype == v.dtype and not q.is_nested
        and (attn_mask is None or isinstance(attn_mask, torch.Tensor) and attn_mask.dtype != torch.bool)
    )


def route(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The fused op SDPA would call on a GPU, or None to let torch take its math path."""
    if not _fused_ok(q, k, v, attn_mask, dropout_p, enable_gqa):
        return None
    backends = torch.backends.cuda
    flash_dims = q.size(-1) == k.size(-1) == v.size(-1) and q.size(-1) <= _MAX_FLASH_HEAD_DIM
    if (backends.flash_sdp_enabled() and attn_mask is None and q.dtype in (torch.float16, torch.bfloat16)
            and flash_dims):
        return _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if backends.mem_efficient_sdp_enabled() and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        # as SDPA does on a GPU: the backward needs the logsumexp, so compute it whenever there will be one
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return _aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, lse, dropout_p, is_causal, scale=scale
        )[0]
    return None


# ---------------------------------------------------------------- CPU kernels (called on the unwrapped tensors)


def flash_forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``_scaled_dot_product_flash_attention`` computed by the CPU flash kernel."""
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
    # as a GPU build: no cumulative sequence lengths for dense inputs and no "unused" tensor (undefined,
    # None here; DTensor's sharding rule expects exactly that), an empty debug mask
    rng_state = torch.zeros(2, dtype=torch.uint64)
    return out, lse, None, None, q.size(2), k.size(2), rng_state, None, q.new_empty(0)


def flash_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   philox_seed, philox_offset, *, scale=None):
    """``_scaled_dot_product_flash_attention_backward`` computed by the CPU flash kernel."""
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, dropout_p, is_causal, scale=scale
    )


def efficient_forward(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """``_scaled_dot_product_efficient_attention`` computed by the CPU flash kernel (which takes a mask)."""
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_bias, scale=scale
    )
    seed = torch.zeros((), dtype=torch.uint64)
    return out, lse if compute_log_sumexp else lse.new_empty(0), seed, seed.clone()


def efficient_backward(grad_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
                       grad_input_mask, is_causal=False, *, scale=None):
    """``_scaled_dot_product_efficient_attention_backward`` by the CPU flash kernel, plus the mask's gradient."""
    gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_bias, scale=scale
    )
    if attn_bias is None or not grad_input_mask[3]:
        return gq, gk, gv, None  # no gradient asked for the mask: undefined, as on a GPU
    return gq, gk, gv, _bias_grad(grad_out, q, k, v, attn_bias, out, is_causal, scale)


def _bias_grad(grad_out, q, k, v, bias, out, is_causal, scale):
    # dS = P * (dP - rowsum(dO * O)) with P recomputed; the mask's gradient is dS summed to its shape
    scale = scale if scale is not None else q.size(-1) ** -0.5
    f = torch.float32
    scores = q.to(f) @ k.to(f).transpose(-2, -1) * scale + bias.to(f)
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    dp = grad_out.to(f) @ v.to(f).transpose(-2, -1)
    ds = p * (dp - (grad_out.to(f) * out.to(f)).sum(-1, keepdim=True))
    return ds.sum_to_size(bias.shape).to(bias.dtype)


CPU_KERNELS = {
    _aten._scaled_dot_product_flash_attention.default: flash_forward,
    _aten._scaled_dot_product_flash_attention_backward.default: flash_backward,
    _aten._scaled_dot_product_efficient_attention.default: efficient_forward,
    _aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward,
}
