"""CUDA-only ops that are not attention, computed on the host: the fused LSTM/GRU cells and ``out_dtype`` matmuls.

A GPU build has only CUDA kernels for these; ``nn.LSTM``/``nn.GRU`` and ``torch._higher_order_ops.out_dtype``
reach them with the emulated tensors' host tensors, so they get CPU kernels
(:data:`shim.ops.attention.CPU_ONLY_ON_GPU` registers them).
"""

from __future__ import annotations

from types import MappingProxyType

import torch


def _mm_dtype(op: str, compute):
    """A ``*.dtype`` matmul (``out_dtype=``): as CUDA, float16/bfloat16 inputs give a float32 result
    accumulated in float32 (which their products are exact in), or the inputs' own dtype."""
    def kernel(*args, **kwargs):
        *tensors, out_dtype = args  # out_dtype is the last positional argument
        if out_dtype != tensors[-1].dtype and not (
            out_dtype == torch.float32 and tensors[-1].dtype in (torch.float16, torch.bfloat16)
        ):
            raise RuntimeError(f"{op}: out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs")
        return compute(*(t.to(out_dtype) for t in tensors), **kwargs)
    return kernel


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """``aten::_thnn_fused_lstm_cell``, which ``nn.LSTM``/``LSTMCell`` call for backend tensors: (hy, cy,
    workspace), the workspace holding the activated gates (i, f, g, o) as the CUDA kernel's does."""
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat((i, f, g, o), 1)


def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """``aten::_thnn_fused_lstm_cell_backward_impl``: (grad of the gates, of cx, of the bias)."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_c = torch.zeros_like(cy) if grad_cy is None else grad_cy.clone()
    grad_o = torch.zeros_like(cy)
    if grad_hy is not None:
        grad_c += grad_hy * o * (1 - tanh_cy * tanh_cy)
        grad_o = grad_hy * tanh_cy
    grad_gates = torch.cat((grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                            grad_o * o * (1 - o)), 1)
    grad_bias = grad_gates.sum(0) if has_bias else grad_gates.new_empty(0)
    return grad_gates, grad_c * f, grad_bias


def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """``aten::_thnn_fused_gru_cell``, which ``nn.GRU``/``GRUCell`` call for backend tensors: (hy, workspace),
    the workspace holding r, z, n, hx and the hidden part of n, as the CUDA kernel's does."""
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return (1 - z) * n + z * hx, torch.cat((r, z, n, hx, hn), 1)


def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """``aten::_thnn_fused_gru_cell_backward``: grads of the input gates, hidden gates, hx and both biases."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * hn * r * (1 - r)
    grad_input = torch.cat((grad_r, grad_z, grad_n), 1)
    grad_hidden = torch.cat((grad_r, grad_z, grad_n * r), 1)
    if not has_bias:
        empty = grad_input.new_empty(0)
        return grad_input, grad_hidden, grad_hy * z, empty, empty
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)


#: name -> CPU kernel, for :data:`shim.ops.attention.CPU_ONLY_ON_GPU`
KERNELS = MappingProxyType({
    "_thnn_fused_lstm_cell": fused_lstm_cell,
    "_thnn_fused_lstm_cell_backward_impl": fused_lstm_cell_backward,
    "_thnn_fused_gru_cell": fused_gru_cell,
    "_thnn_fused_gru_cell_backward": fused_gru_cell_backward,
    "mm.dtype": _mm_dtype("mm", torch.mm),
    "bmm.dtype": _mm_dtype("bmm", torch.bmm),
    "addmm.dtype": _mm_dtype("addmm", torch.addmm),
    "baddbmm.dtype": _mm_dtype("baddbmm", torch.baddbmm),
})
