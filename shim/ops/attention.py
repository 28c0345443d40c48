"""``scaled_dot_product_attention`` on the emulated GPUs reaches the fused ops a GPU build uses.

On a ROCm GPU, SDPA picks flash attention (fp16/bf16, no mask) or memory-
efficient attention (also fp32, takes a mask) before the math fallback, and
the rest of torch is written against those ops: DTensor has sharding rules
for ``_scaled_dot_product_flash_attention`` and
``_scaled_dot_product_efficient_attention`` (and their backwards), not for
the math decomposition. So :func:`route` makes the same choice (honouring
``torch.backends.cuda.*_sdp_enabled`` and ``sdpa_kernel``), and the CPU
kernels below compute those ops on the reference CPU path.

The other ops a GPU build has only CUDA kernels for and torch can compute on
the CPU (the raw flash/memory-efficient/cuDNN attention kernels that varlen
attention calls, the fused LSTM/GRU cells, the ``out_dtype`` matmuls) get CPU
kernels (:data:`CPU_ONLY_ON_GPU`, the non-attention ones in :mod:`shim.ops.cpu_only`), and
higher-order ops (flex attention, ``torch.cond``...) a rule for the emulated tensors
(:mod:`shim.ops.higher_order`).
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from shim.ops import cpu_only, higher_order

_aten = torch.ops.aten
_MAX_FLASH_HEAD_DIM = 256


def _fused_ok(q, k, v, attn_mask, dropout_p) -> bool:
    # dropout needs the GPU's philox stream, which the CPU kernels cannot reproduce: math path then
    return (
        q.device.type == "cuda" and dropout_p == 0.0 and q.dim() == 4
        and q.dtype == k.dtype == v.dtype and not q.is_nested
        and (attn_mask is None or isinstance(attn_mask, torch.Tensor) and attn_mask.dtype != torch.bool)
    )


def route(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The fused op SDPA would call on a GPU, or None to let torch take its math path."""
    if not _fused_ok(q, k, v, attn_mask, dropout_p):
        return None
    if torch.is_autocast_enabled("cuda"):
        # SDPA is a lower-precision op under autocast, cast before a GPU picks its kernel: choose on
        # the cast tensors (route runs above the dispatcher, where the autocast kernel would have)
        from shim.device.autocast import cast_lower

        q, k, v, attn_mask = cast_lower((q, k, v, attn_mask))
    backends = torch.backends.cuda
    flash_dims = q.size(-1) == k.size(-1) == v.size(-1) and q.size(-1) <= _MAX_FLASH_HEAD_DIM
    if (backends.flash_sdp_enabled() and attn_mask is None and q.dtype in (torch.float16, torch.bfloat16)
            and flash_dims):
        return _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if enable_gqa and q.size(1) != k.size(1):
        return None  # grouped-query heads: flash takes them, ROCm's memory-efficient kernel does not (sdp_utils.cpp)
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


# ------------------------------------------------ the raw fused kernels (varlen attention calls them directly)
#
# A CUDA build has only CUDA kernels for these; torch.nn.attention.varlen and libraries built on flash
# attention call them directly, inside custom ops whose bodies run on the CPU tensors here. They are
# registered as the CPU kernels of the ops (install) and computed by the CPU flash kernel
# per sequence, with the masks the GPU kernels apply.


def _unsupported(op: str, what: str):
    return NotImplementedError(f"{op} with {what} is not supported on mirage's emulated GPUs")


def _mask(sq: int, sk: int, is_causal: bool, left, right, bottom_right: bool, dtype):
    """The additive mask of causal/sliding-window attention, or None when every position is kept.

    Flash attention aligns the diagonal to the bottom right when the lengths differ (query i sees
    key j <= i + sk - sq); SDPA and cuDNN to the top left.
    """
    left = -1 if left is None else left
    right = 0 if is_causal else (-1 if right is None else right)
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq).unsqueeze(1) + (sk - sq if bottom_right else 0)
    j = torch.arange(sk).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return torch.zeros(sq, sk, dtype=dtype).masked_fill(~keep, float("-inf"))


def _combine(mask, bias):
    if bias is None:
        return mask
    return bias if mask is None else bias + mask


def _expand_heads(k, v, heads: int):
    # grouped-query attention: each key/value head serves heads // k.size(1) query heads (BHSD)
    if k.size(1) == heads:
        return k, v
    group = heads // k.size(1)
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def _reduce_heads(g, kv_heads: int):
    if g.size(1) == kv_heads:
        return g
    return g.unflatten(1, (kv_heads, g.size(1) // kv_heads)).sum(2)


def _attend(q, k, v, mask, scale):
    """Attention of BHSD tensors by the CPU flash kernel: (out, logsumexp of shape B, H, Sq)."""
    k, v = _expand_heads(k, v, q.size(1))
    if mask is not None:
        mask = mask.to(q.dtype)
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def _attend_backward(grad_out, q, k, v, out, lse, mask, scale):
    kv_heads = k.size(1)
    k, v = _expand_heads(k, v, q.size(1))
    if mask is not None:
        mask = mask.to(q.dtype)
    gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )
    return gq, _reduce_heads(gk, kv_heads), _reduce_heads(gv, kv_heads)


def _sequences(cum_q, cum_k, total_q: int, total_k: int):
    """(query slice, key slice) of each sequence of a varlen batch (one of the whole when not varlen)."""
    if cum_q is None:
        return [(slice(0, total_q), slice(0, total_k))]
    cq, ck = cum_q.tolist(), cum_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def _bshd_forward(q, k, v, cum_q, cum_k, is_causal, scale, left, right, bottom_right, bias=None):
    """Forward of BSHD (or, with cumulative lengths, THD varlen) inputs: (out, logsumexp as B, H, S / H, T)."""
    if cum_q is None:  # dense: (B, S, H, D) -> (B, H, S, D)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        mask = _combine(_mask(q.size(1), k.size(1), is_causal, left, right, bottom_right, q.dtype), bias)
        out, lse = _attend(qt, kt, vt, mask, scale)
        return out.transpose(1, 2).contiguous(), lse
    out = torch.zeros_like(q)
    lse = torch.zeros(q.size(1), q.size(0), dtype=torch.float32)
    for sq, sk in _sequences(cum_q, cum_k, q.size(0), k.size(0)):
        qs, ks, vs = (t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, sq), (k, sk), (v, sk)))
        mask = _mask(qs.size(2), ks.size(2), is_causal, left, right, bottom_right, q.dtype)
        o, lse_s = _attend(qs, ks, vs, mask, scale)
        out[sq] = o[0].transpose(0, 1)
        lse[:, sq] = lse_s[0]
    return out, lse


def _bshd_backward(grad_out, q, k, v, out, lse, cum_q, cum_k, is_causal, scale, left, right, bottom_right,
                   bias=None):
    if cum_q is None:
        t = [x.transpose(1, 2) for x in (grad_out, q, k, v, out)]
        mask = _combine(_mask(q.size(1), k.size(1), is_causal, left, right, bottom_right, q.dtype), bias)
        gq, gk, gv = _attend_backward(*t, lse, mask, scale)
        return tuple(g.transpose(1, 2).contiguous() for g in (gq, gk, gv))
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, sk in _sequences(cum_q, cum_k, q.size(0), k.size(0)):
        go_s, qs, os_ = (x[sq].transpose(0, 1).unsqueeze(0) for x in (grad_out, q, out))
        ks, vs = (x[sk].transpose(0, 1).unsqueeze(0) for x in (k, v))
        mask = _mask(qs.size(2), ks.size(2), is_causal, left, right, bottom_right, q.dtype)
        g = _attend_backward(go_s, qs, ks, vs, os_, lse[:, sq].unsqueeze(0).contiguous(), mask, scale)
        gq[sq], gk[sk], gv[sk] = (x[0].transpose(0, 1) for x in g)
    return gq, gk, gv


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` (dense BSHD or varlen THD) by the CPU flash kernel."""
    op = "aten::_flash_attention_forward"
    if dropout_p:
        raise _unsupported(op, "dropout_p > 0 (the GPU's philox stream cannot be reproduced)")
    for name, value_ in (("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes), ("block_table", block_table)):
        if value_ is not None:
            raise _unsupported(op, name)
    out, lse = _bshd_forward(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left,
                             window_size_right, bottom_right=True)
    rng_state = torch.zeros(2, dtype=torch.uint64)  # as flash_forward above: no dropout, no state to keep
    return out, lse, rng_state, torch.empty(0, dtype=torch.uint64), query.new_empty(0)


def flash_attention_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                    is_causal, return_debug_mask, **kwargs):
    """``aten::_flash_attention_forward_no_dropout_inplace``: the forward, written into ``out``; the logsumexp."""
    result, lse, *_ = flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                              is_causal, return_debug_mask, **kwargs)
    out.copy_(result)
    return lse


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    """``aten::_flash_attention_backward`` by the CPU flash kernel's backward."""
    if dropout_p:
        raise _unsupported("aten::_flash_attention_backward", "dropout_p > 0")
    if cum_seq_q is not None and cum_seq_q.numel() == 0:
        cum_seq_q = cum_seq_k = None  # SDPA's dense flash passes empty tensors here
    return _bshd_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, is_causal, scale,
                          window_size_left, window_size_right, bottom_right=True)


#: xformers' custom_mask_type: none, causal from the top left, causal from the bottom right
_EFFICIENT_MASKS = MappingProxyType({0: (False, False), 1: (True, False), 2: (True, True)})


def efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p, custom_mask_type, compute_log_sumexp=False, *, scale=None,
                                seqlen_k=None, window_size=None):
    """``aten::_efficient_attention_forward`` (BSHD, optional bias and varlen) by the CPU flash kernel."""
    op = "aten::_efficient_attention_forward"
    if dropout_p:
        raise _unsupported(op, "dropout_p > 0 (the GPU's philox stream cannot be reproduced)")
    if seqlen_k is not None:
        raise _unsupported(op, "seqlen_k")
    if cu_seqlens_q is not None and bias is not None:
        raise _unsupported(op, "a bias on varlen inputs")
    is_causal, bottom_right = _EFFICIENT_MASKS[custom_mask_type]
    out, lse = _bshd_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, window_size, None,
                             bottom_right, bias=bias)
    if cu_seqlens_q is not None:  # varlen: the GPU keeps (sequences, H, max_seqlen_q), padded
        lse = _varlen_lse_as_batch(lse, cu_seqlens_q, max_seqlen_q)
    m = query.size(1) if cu_seqlens_q is None else max_seqlen_q
    n = key.size(1) if cu_seqlens_k is None else max_seqlen_k
    padded = -(-m // 32) * 32 if compute_log_sumexp else 0  # the GPU's logsumexp is padded to 32 rows
    lse_out = lse.new_zeros(lse.size(0), lse.size(1), padded)
    if padded:
        lse_out[..., :lse.size(2)] = lse
    seed = torch.zeros((), dtype=torch.long)
    return out, lse_out, seed, seed.clone(), m, n


def _varlen_lse_as_batch(lse, cum, max_len):
    cq = cum.tolist()
    batch = lse.new_zeros(len(cq) - 1, lse.size(0), max_len)
    for b in range(len(cq) - 1):
        batch[b, :, :cq[b + 1] - cq[b]] = lse[:, cq[b]:cq[b + 1]]
    return batch


def efficient_attention_backward(grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
                                 bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
                                 shared_storage_dqdkdv=False):
    """``aten::_efficient_attention_backward`` by the CPU flash kernel's backward, plus the bias's gradient."""
    if dropout_p:
        raise _unsupported("aten::_efficient_attention_backward", "dropout_p > 0")
    is_causal, bottom_right = _EFFICIENT_MASKS[custom_mask_type]
    if cu_seqlens_q is None:
        lse = logsumexp[..., :query.size(1)].contiguous()
    else:  # back from the padded (sequences, H, max) layout to (H, total)
        cq = cu_seqlens_q.tolist()
        lse = torch.cat([logsumexp[b, :, :cq[b + 1] - cq[b]] for b in range(len(cq) - 1)], dim=1)
    gq, gk, gv = _bshd_backward(grad_out_, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, is_causal,
                                scale, window_size, None, bottom_right, bias=bias)
    if bias is None:
        return gq, gk, gv, torch.empty(())
    if not bias_requires_grad:
        return gq, gk, gv, torch.zeros_like(bias)
    t = [x.transpose(1, 2) for x in (grad_out_, query, key, value, out)]
    k, v = _expand_heads(t[2], t[3], t[1].size(1))
    mask = _combine(_mask(query.size(1), key.size(1), is_causal, None, None, bottom_right, bias.dtype), bias)
    return gq, gk, gv, _bias_grad(t[0], t[1], k, v, mask, t[4], False, scale).to(bias.dtype)


def cudnn_attention_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                            return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_cudnn_attention`` (BHSD) by the CPU flash kernel."""
    if dropout_p:
        raise _unsupported("aten::_scaled_dot_product_cudnn_attention", "dropout_p > 0")
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    seed = torch.zeros((), dtype=torch.long)
    return out, lse.unsqueeze(-1), None, None, query.size(2), key.size(2), seed, seed.clone(), None


def cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                             cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    """``aten::_scaled_dot_product_cudnn_attention_backward`` by the CPU flash kernel's backward."""
    if dropout_p:
        raise _unsupported("aten::_scaled_dot_product_cudnn_attention_backward", "dropout_p > 0")
    if attn_bias is not None and attn_bias.numel() == 0:
        attn_bias = None
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp.squeeze(-1), 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )


CPU_KERNELS = MappingProxyType({
    _aten._scaled_dot_product_flash_attention.default: flash_forward,
    _aten._scaled_dot_product_flash_attention_backward.default: flash_backward,
    _aten._scaled_dot_product_efficient_attention.default: efficient_forward,
    _aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward,
})


#: CUDA-only ops computed here when they reach the CPU (the wrappers' CPU tensors); name -> kernel
CPU_ONLY_ON_GPU = MappingProxyType({
    **cpu_only.KERNELS,
    "_flash_attention_forward": flash_attention_forward,
    "_flash_attention_forward_no_dropout_inplace": flash_attention_forward_inplace,
    "_flash_attention_backward": flash_attention_backward,
    "_efficient_attention_forward": efficient_attention_forward,
    "_efficient_attention_backward": efficient_attention_backward,
    "_scaled_dot_product_cudnn_attention": cudnn_attention_forward,
    "_scaled_dot_product_cudnn_attention_backward": cudnn_attention_backward,
})

_libs: list[torch.library.Library] = []


def install(tensor_type: type) -> None:
    """Register :data:`CPU_ONLY_ON_GPU` as CPU kernels, SDPA's choice for the backend, and let higher-order
    ops take ``tensor_type`` (:func:`shim.ops.higher_order.install`).

    The ops have only CUDA kernels in a GPU build, so on a CPU tensor of a GPU build they would raise
    too; here they are reached with the wrappers' CPU tensors (through ``__torch_dispatch__``, and
    inside custom ops such as varlen attention's, whose bodies run on them).
    """
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    for name, kernel in CPU_ONLY_ON_GPU.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            lib.impl(name, kernel, "CPU")
    higher_order.install(tensor_type)
    # SDPA's choice at the dispatcher too, not only in shim/cuda/mode.py's TorchFunctionMode: the mode is
    # off inside backward() (activation checkpointing recomputes there) and in threads it never
    # entered, and a recomputation must pick the kernel the forward picked
    lib.impl("scaled_dot_product_attention", _sdpa_routed, "AutogradPrivateUse1")


def _sdpa_routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                 enable_gqa=False):
    """``scaled_dot_product_attention`` on emulated tensors: :func:`route`'s fused op, else torch's math path."""
    out = route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA does before its math path
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(), -float("inf"))
    return _aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]
