"""Ops a GPU build runs that have only CUDA kernels (issue 15, item 7), on emulated cuda against the CPU.

The raw flash / memory-efficient / cuDNN attention kernels (which
``torch.nn.attention.varlen`` and flash-attention libraries call directly), flex
attention forward and backward (eager, under ``torch.compile`` and autocast),
the ``out_dtype`` matmuls, ``nn.LSTM``/``nn.GRU`` (their fused cells) and
``torch.cond``: outputs and gradients on emulated cuda against the CPU (the
attention ops against a float64 reference computed by plain autograd). One real
``mirage run --in-process`` process, no mocks.
"""

from __future__ import annotations

import pytest

from tests.test_run import mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")

PROGRAM = r'''
import torch

a = torch.ops.aten
torch.manual_seed(0)


def ref(q, k, v, mask=None, scale=None):
    """Attention of BHSD float64 tensors, by autograd-able math (GQA: key/value heads repeated)."""
    if k.size(1) != q.size(1):
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), 1) for t in (k, v))
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else q.size(-1) ** -0.5)
    if mask is not None:
        s = s + mask
    return torch.softmax(s, -1) @ v


def leaves(*shapes):
    cpu = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    return [t.float().cuda().requires_grad_() for t in cpu], [t.requires_grad_() for t in cpu]


def check(name, got, want, got_leaves, want_leaves, tol=2e-5):
    assert got.device.type == "cuda", (name, got.device)
    err = (got.detach().cpu().double() - want.detach()).abs().max().item()
    assert err < tol, (name, "output", err)
    cot = torch.randn(want.shape, dtype=torch.float64)
    got.backward(cot.float().cuda())
    want.backward(cot)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert g.grad is not None and g.grad.device.type == "cuda", (name, i)
        err = (g.grad.cpu().double() - w.grad).abs().max().item()
        assert err < tol * 10, (name, "grad", i, err)
    print(f"{name} ok")


def band(sq, sk, left=-1, right=-1, bottom_right=True):
    i = torch.arange(sq)[:, None] + (sk - sq if bottom_right else 0)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return torch.zeros(sq, sk, dtype=torch.float64).masked_fill(~keep, float("-inf"))


B, S, H, D = 2, 6, 4, 8
# flash, dense BSHD, causal, grouped-query (4 query heads on 2 key/value heads)
(q, k, v), (rq, rk, rv) = leaves((B, S, H, D), (B, S, 2, D), (B, S, 2, D))
out = a._flash_attention_forward(q, k, v, None, None, S, S, 0.0, True, False)[0]
want = ref(*(t.transpose(1, 2) for t in (rq, rk, rv)), band(S, S, right=0)).transpose(1, 2)
check("_flash_attention_forward causal gqa", out, want, (q, k, v), (rq, rk, rv))

# flash, sliding window, query shorter than key (bottom-right aligned, as flash attention)
(q, k, v), (rq, rk, rv) = leaves((B, 4, H, D), (B, S, H, D), (B, S, H, D))
out = a._flash_attention_forward(q, k, v, None, None, 4, S, 0.0, False, False, window_size_left=2,
                                 window_size_right=1)[0]
want = ref(*(t.transpose(1, 2) for t in (rq, rk, rv)), band(4, S, 2, 1)).transpose(1, 2)
check("_flash_attention_forward window", out, want, (q, k, v), (rq, rk, rv))

# varlen attention (torch.nn.attention.varlen: a custom op calling _flash_attention_forward/backward)
from torch.nn.attention.varlen import varlen_attn

cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
(q, k, v), (rq, rk, rv) = leaves((10, H, D), (10, H, D), (10, H, D))
out = varlen_attn(q, k, v, cu.cuda(), cu.cuda(), 5, 5, window_size=(-1, 0))
seqs = [(0, 3), (3, 8), (8, 10)]
want = torch.cat([ref(*(t[s:e].transpose(0, 1) for t in (rq, rk, rv)), band(e - s, e - s, right=0)).transpose(0, 1)
                  for s, e in seqs])
check("varlen_attn causal", out, want, (q, k, v), (rq, rk, rv))

# memory-efficient attention with a bias (its gradient too), causal from the top left
(q, k, v, bias), (rq, rk, rv, rbias) = leaves((B, S, H, D), (B, S, H, D), (B, S, H, D), (B, H, S, S))
out = a._efficient_attention_forward(q, k, v, bias, None, None, None, None, 0.0, 1, True)[0]
want = ref(*(t.transpose(1, 2) for t in (rq, rk, rv)), rbias + band(S, S, right=0, bottom_right=False))
check("_efficient_attention_forward bias causal", out, want.transpose(1, 2), (q, k, v, bias), (rq, rk, rv, rbias))

# the SDPA-level fused ops, BHSD
(q, k, v), (rq, rk, rv) = leaves((B, H, S, D), (B, H, S, D), (B, H, S, D))
out = a._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0]
check("_scaled_dot_product_cudnn_attention causal", out, ref(rq, rk, rv, band(S, S, right=0)), (q, k, v),
      (rq, rk, rv))
(q, k, v), (rq, rk, rv) = leaves((B, H, S, D), (B, H, S, D), (B, H, S, D))
out = a._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
check("_scaled_dot_product_flash_attention causal", out, ref(rq, rk, rv, band(S, S, right=0)), (q, k, v),
      (rq, rk, rv))
(q, k, v, m), (rq, rk, rv, rm) = leaves((B, H, S, D), (B, H, S, D), (B, H, S, D), (B, H, S, S))
out = a._scaled_dot_product_efficient_attention(q, k, v, m, True)[0]
check("_scaled_dot_product_efficient_attention mask", out, ref(rq, rk, rv, rm), (q, k, v, m), (rq, rk, rv, rm))

# flex attention with a score_mod and a block mask, eager and compiled
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def score_mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


S = 128
block_mask = create_block_mask(causal, B, H, S, S, device="cuda")
idx = torch.arange(S, dtype=torch.float64)
flex_bias = (idx[:, None] - idx[None, :]) * 0.1 + band(S, S, right=0)
for name, fn in (("flex_attention eager", flex_attention), ("flex_attention compiled", torch.compile(flex_attention))):
    (q, k, v), (rq, rk, rv) = leaves((B, H, S, D), (B, H, S, D), (B, H, S, D))
    out = fn(q, k, v, score_mod=score_mod, block_mask=block_mask)
    check(name, out, ref(rq, rk, rv, flex_bias), (q, k, v), (rq, rk, rv))

# under cuda autocast flex attention runs in the autocast dtype (its AutocastCUDA rule)
(q, k, v), (rq, rk, rv) = leaves((B, H, S, D), (B, H, S, D), (B, H, S, D))
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
assert out.dtype == torch.bfloat16, out.dtype
assert (out.cpu().double() - ref(rq, rk, rv, flex_bias)).abs().max().item() < 0.05
out.float().sum().backward()
assert q.grad.dtype == torch.float32 and q.grad.device.type == "cuda"
print("flex_attention autocast ok")

# out_dtype matmuls: bfloat16 inputs, float32 results
x, y = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
got = torch.mm(x.cuda(), y.cuda(), out_dtype=torch.float32)
assert got.dtype == torch.float32 and torch.equal(got.cpu(), x.float() @ y.float()), got
got = torch.addmm(torch.ones(3, 5, device="cuda"), x.cuda(), y.cuda(), out_dtype=torch.float32)
assert torch.equal(got.cpu(), 1 + x.float() @ y.float())
got = torch.bmm(x[None].cuda(), y[None].cuda(), out_dtype=torch.float32)
assert torch.equal(got.cpu(), (x.float() @ y.float())[None])
print("out_dtype matmuls ok")

# nn.LSTM / nn.GRU: for backend tensors C++ calls the fused cells, which have only CUDA kernels
for cls in (torch.nn.LSTM, torch.nn.GRU):
    for bias in (True, False):
        cpu = cls(4, 8, num_layers=2, batch_first=True, bias=bias)
        cuda = cls(4, 8, num_layers=2, batch_first=True, bias=bias)
        cuda.load_state_dict(cpu.state_dict())
        cuda.cuda()
        x = torch.randn(2, 5, 4, requires_grad=True)
        xc = x.detach().cuda().requires_grad_()
        cot = torch.randn(2, 5, 8)
        want, got = cpu(x)[0], cuda(xc)[0]
        assert got.device.type == "cuda" and torch.allclose(got.cpu(), want, atol=1e-6), cls
        want.backward(cot)
        got.backward(cot.cuda())
        for w, g in zip([x, *cpu.parameters()], [xc, *cuda.parameters()]):
            assert torch.allclose(g.grad.cpu(), w.grad, atol=1e-5), (cls, bias)
    print(f"{cls.__name__} ok")

# other higher-order ops run eagerly on the emulated tensors too
t = torch.arange(4.0, device="cuda")
assert torch.cond(t.sum() > 0, lambda u: u + 1, lambda u: u - 1, (t,)).cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
print("torch.cond ok")

# what cannot be emulated is refused in one line naming the op
try:
    a._flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, S, S, 0.5,
                               False, False)
except NotImplementedError as e:
    print("refused:", e)
print("attention_ops_ok")
'''


def test_gpu_only_attention_ops_and_flex_attention_match_the_cpu(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--", "python", "-c", PROGRAM)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line.removeprefix("[0] ") for line in r.stdout.splitlines()]
    for name in ("_flash_attention_forward causal gqa", "_flash_attention_forward window", "varlen_attn causal",
                 "_efficient_attention_forward bias causal", "_scaled_dot_product_cudnn_attention causal",
                 "_scaled_dot_product_flash_attention causal", "_scaled_dot_product_efficient_attention mask",
                 "flex_attention eager", "flex_attention compiled", "flex_attention autocast", "out_dtype matmuls",
                 "torch.cond", "LSTM", "GRU"):
        assert f"{name} ok" in lines, r.stdout[-3000:]
    assert ("refused: aten::_flash_attention_forward with dropout_p > 0 (the GPU's philox stream cannot be "
            "reproduced) is not supported on mirage's emulated GPUs") in lines
    assert "attention_ops_ok" in lines


SDPA_EVERYWHERE = r'''
import threading

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
mask = torch.rand(5, 5) > 0.3
cases = [dict(attn_mask=mask), dict(attn_mask=mask.float()), dict(is_causal=True), dict(scale=0.3)]


def on_gpu(kw):
    kw = {n: a.cuda() if isinstance(a, torch.Tensor) else a for n, a in kw.items()}
    return F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), **kw).cpu()


def thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


for kw in cases:  # the same answer in the main thread and in one the cuda mode never entered
    expected = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(on_gpu(kw), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(thread(lambda: on_gpu(kw)), expected, atol=1e-5, rtol=1e-5)
assert thread(lambda: F.scaled_dot_product_attention(*(t.half().cuda() for t in (q, k, v))).grad_fn) is None
x16 = torch.randn(2, 4, 16, 64, dtype=torch.float16, device="cuda", requires_grad=True)
name = thread(lambda: F.scaled_dot_product_attention(x16, x16, x16, is_causal=True).grad_fn.name())
assert name == "ScaledDotProductFlashAttentionBackward0", name

# activation checkpointing recomputes inside backward(): the same fused kernel, the same gradients
for dtype in (torch.float32, torch.bfloat16):
    base = torch.randn(2, 4, 16, 64, dtype=dtype)
    grads = []
    for use_checkpoint in (False, True):
        x = base.cuda().requires_grad_()
        attend = lambda x: F.scaled_dot_product_attention(x, 2 * x, 3 * x, is_causal=True)
        (checkpoint(attend, x, use_reentrant=False) if use_checkpoint else attend(x)).sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])
print("sdpa_everywhere_ok")
'''


def test_sdpa_picks_the_same_kernel_in_threads_and_under_activation_checkpointing(tmp_path):
    """SDPA's kernel choice is made at the dispatcher, not only in the per-thread cuda mode: a thread the
    mode never entered and a checkpointed recomputation (inside backward) pick the forward's fused kernel."""
    r = mirage_run(tmp_path, "--in-process", "--", "python", "-c", SDPA_EVERYWHERE)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] sdpa_everywhere_ok" in r.stdout.splitlines()
