"""``torch.compile`` on the emulated GPUs (issue 28): dynamo captures, inductor compiles, results are eager's.

Each test runs one real ``mirage run --in-process`` process (no mocks): the
program compiles with the default backend and checks what a GPU run shows —
graphs captured (``counters["stats"]["unique_graphs"]``, ``torch._dynamo.explain``),
kernels generated (``torch._inductor.metrics.generated_kernel_count``), outputs
on ``cuda:i`` equal to eager within inductor's usual tolerance, gradients too —
for every form of ``torch.compile``. Distributed programs under compile (DDP,
FSDP2, TP, functional collectives) are compared with CPU + gloo in
``tests/test_compile_distributed.py``.
"""

from __future__ import annotations

import json

import pytest

from tests.test_run import mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")

PROGRAM = r'''
import torch
import torch._dynamo
import torch._inductor.metrics as metrics
import torch.nn.functional as F
from torch._dynamo.utils import counters


def close(a, b, tol=1e-5):
    return a.device == b.device and torch.allclose(a, b, atol=tol, rtol=tol)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).cuda()
x = torch.randn(5, 8, device="cuda")
want = model(x)

# the default backend: a graph captured, C++ kernels generated for the host memory behind cuda:0
compiled = torch.compile(model)
got = compiled(x)
assert got.device == torch.device("cuda", 0) and close(got, want), (got, want)
assert counters["stats"]["unique_graphs"] >= 1 and metrics.generated_kernel_count > 0
print("graphs", counters["stats"]["unique_graphs"], "kernels", metrics.generated_kernel_count)

# forward and backward: the gradients of eager
compiled(x).square().sum().backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
model(x).square().sum().backward()
assert all(close(g, p.grad) for g, p in zip(grads, model.parameters()))


@torch.compile  # at definition, as libraries do at import
def double(t):
    return t * 2


def positions_of(t):
    # factories and moves naming cuda inside the graph: made on the host, put on the GPU
    pos = torch.arange(t.shape[-1], device=t.device)
    return t + pos + torch.zeros(t.shape[-1], device="cuda") + torch.ones(t.shape[-1]).to("cuda")


positions = torch.compile(positions_of, fullgraph=True, dynamic=True)


assert close(double(x), x * 2)
for rows in (5, 7):  # dynamic=True: one graph for both shapes
    t = torch.randn(rows, 8, device="cuda")
    assert close(positions(t), t + torch.arange(8, device="cuda") + 1)
explained = torch._dynamo.explain(positions_of)(x)
print("explain", explained.graph_count, explained.graph_break_count)
assert explained.graph_count == 1 and explained.graph_break_count == 0

for backend in ("aot_eager", "eager", lambda gm, inputs: gm):
    assert close(torch.compile(model, backend=backend)(x), want)
for mode in ("max-autotune-no-cudagraphs", "reduce-overhead"):
    assert close(torch.compile(model, mode=mode)(x), want)
try:
    torch.compile(model, mode="default", options={"max_autotune": True})
except RuntimeError as e:
    print("mode and options:", e)

# attention and dropout in a graph: SDPA picks the GPU's kernel, dropout draws as inductor draws
q = torch.randn(2, 4, 16, 8, device="cuda")
assert close(torch.compile(lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True))(q),
             F.scaled_dot_product_attention(q, q, q, is_causal=True), 1e-4)
dropped = torch.compile(lambda t: F.dropout(t, 0.5, training=True))(torch.ones(64, 64, device="cuda"))
zeros = (dropped == 0).float().mean().item()
assert dropped.device.type == "cuda" and 0.4 < zeros < 0.6 and set(dropped.unique().tolist()) <= {0.0, 2.0}

# a graph break, with its reason, as on a GPU
def with_break(t):
    t = t + 1
    print("host side")
    return t * 2

breaks = torch._dynamo.explain(with_break)(x)
assert breaks.graph_break_count == 1, breaks.break_reasons
assert close(torch.compile(with_break)(x), (x + 1) * 2)

model.compile()  # nn.Module.compile
assert close(model(x), want)


@torch.compiler.disable
def minus_one(t):
    return t - 1


assert close(torch.compile(lambda t: minus_one(t) * 3)(x), (x - 1) * 3)
assert torch.compiler.is_compiling() is False
torch._dynamo.reset()
torch.compiler.reset()
print("compile_ok")
'''


def _lines(text: str) -> list[str]:
    return [line.removeprefix("[0] ") for line in text.splitlines()]


HIGHER_ORDER = r'''
import torch
import torch._inductor.metrics as metrics
from torch._dynamo.utils import counters
from torch._higher_order_ops import while_loop
from torch._subclasses.fake_tensor import FakeTensorMode
from functorch.experimental.control_flow import map as hop_map
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

counters.clear()  # after PROGRAM, in the same process: its graph breaks are not this program's
torch.manual_seed(0)
B, H, S, D = 2, 2, 128, 16
bias = torch.randn(S) * 0.1
on_gpu_bias = bias.cuda()  # captured by the score function: dynamo lifts it into the op's buffers


def score_mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1 + on_gpu_bias[kv_idx]


def host_score_mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1 + bias[kv_idx]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def reference(q, k, v):
    """The same attention in float64 by plain autograd (the CPU's flex attention takes no gradients)."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    s = q @ k.transpose(-2, -1) * D ** -0.5 + (i - j) * 0.1 + bias.double()[j]
    return torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v


block_mask = create_block_mask(causal, B, H, S, S, device="cuda")
host_mask = create_block_mask(causal, B, H, S, S, device="cpu")
leaves = [torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3)]
q, k, v = (t.float().cuda().requires_grad_() for t in leaves)
rq, rk, rv = (t.clone().requires_grad_() for t in leaves)

# flex attention trained under torch.compile: one graph, kernels generated, the reference's numbers
compiled = torch.compile(flex_attention, fullgraph=True)
metrics.generated_kernel_count = 0
out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
want = reference(rq, rk, rv)
cot = torch.randn_like(want)
out.backward(cot.float().cuda())
want.backward(cot)
assert out.device == torch.device("cuda", 0), out.device
assert (out.cpu().double() - want).abs().max() < 2e-5, (out.cpu().double() - want).abs().max()
for got, ref in zip((q, k, v), (rq, rk, rv)):
    assert got.grad.device.type == "cuda" and (got.grad.cpu().double() - ref.grad).abs().max() < 2e-4
assert metrics.generated_kernel_count > 0 and not counters["graph_break"], dict(counters["graph_break"])
print("flex attention trained compiled, kernels", metrics.generated_kernel_count)

# inference: inductor's C++ flex attention template, as it compiles plain CPU tensors
with torch.no_grad():
    got = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    hq, hk, hv = (t.float() for t in leaves)
    host = torch.compile(flex_attention, fullgraph=True)(hq, hk, hv, score_mod=host_score_mod, block_mask=host_mask)
assert torch.allclose(got.cpu(), host, atol=1e-5, rtol=1e-5), (got.cpu() - host).abs().max()
print("flex attention inference compiled")

# control flow: torch.cond, while_loop and map in one graph each, values and gradients as eager
def branchy(t):
    return torch.cond(t.sum() > 0, lambda u: (u * u).sin(), lambda u: u.cos(), (t,)) * 2


def doubling(t):
    return while_loop(lambda i, u: i < 3, lambda i, u: (i + 1, u * 2), (torch.tensor(0, device=t.device), t))[1]


for fn in (branchy, doubling, lambda t: hop_map(lambda row: row.exp(), t)):
    for sign in (1, -1):
        t = sign * torch.arange(6.0).reshape(2, 3) / 6
        got = torch.compile(fn, fullgraph=True)(t.cuda())
        assert got.device.type == "cuda" and torch.allclose(got.cpu(), fn(t), atol=1e-6), (fn, got, fn(t))
for sign in (1, -1):
    t = (sign * torch.arange(6.0) / 6).requires_grad_()
    g = t.detach().cuda().requires_grad_()
    torch.compile(branchy, fullgraph=True)(g).sum().backward()
    branchy(t).sum().backward()
    assert torch.allclose(g.grad.cpu(), t.grad, atol=1e-6), (g.grad, t.grad)
assert not counters["graph_break"], dict(counters["graph_break"])
print("control flow compiled")

# a number beside an emulated tensor (torch.where's 7), traced: one graph
m = torch.arange(4, device="cuda") % 2 == 0
assert torch.compile(lambda m, x: torch.where(m, x, 7), fullgraph=True)(m, m.int()).tolist() == [1, 7, 1, 7]
# a traced emulated tensor prints as a fake one, without reading data it has not
with FakeTensorMode() as mode:
    print("traced:", repr(mode.from_tensor(m)))
print("higher_order_ok")
'''


def test_torch_compile_compiles_on_the_emulated_gpu(tmp_path):
    """Every form of torch.compile (PROGRAM), then higher-order ops (HIGHER_ORDER): flex attention (trained: its
    dense math compiled, as the CPU template is inference-only; inference: the template), torch.cond / while_loop /
    map with fullgraph=True, against eager on the CPU. One process runs both, one after the other: a start of
    torch and of inductor less than a run each (they are the slowest tests of the default suite)."""
    r = mirage_run(tmp_path, "--in-process", "--", "python", "-c", PROGRAM + HIGHER_ORDER, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _lines(r.stdout)
    assert "compile_ok" in lines, r.stdout[-3000:]
    assert "explain 1 0" in lines
    assert "mode and options: Either mode or options can be specified, but both can't be specified at the same time." \
        in lines
    assert "runs eagerly" not in r.stderr  # the old notice is gone from the default path
    assert "higher_order_ok" in lines, r.stdout[-3000:]
    assert "traced: tensor(..., device='cuda:0', size=(4,), dtype=torch.bool)" in lines

LOGGED = r'''
import torch

x = torch.randn(4, 8, device="cuda")


@torch.compile(dynamic=False)
def f(t):
    t = t.sin()
    print("a graph break")
    return t.cos()


f(x)
f(torch.randn(6, 8, device="cuda"))  # another shape, dynamic=False: recompiled
print("logged_ok")
'''


def test_torch_logs_print_graph_breaks_and_recompiles_as_on_a_gpu(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--env", "TORCH_LOGS=graph_breaks,recompiles", "--", "python", "-c",
                   LOGGED, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "logged_ok" in _lines(r.stdout)
    assert "Graph break in user code" in r.stderr and "builtin print" in r.stderr, r.stderr[-3000:]
    assert "Recompiling function f" in r.stderr, r.stderr[-3000:]


EAGER = r'''
import torch
from torch._dynamo.utils import counters

model = torch.nn.Linear(4, 4).cuda()
x = torch.randn(2, 4, device="cuda")
assert torch.compile(model) is model
assert torch.equal(torch.compile(fullgraph=True)(lambda t: t + 1)(x), x + 1)
assert not counters["stats"]["unique_graphs"]
print("eager_ok")
'''


def test_mirage_compile_eager_keeps_torch_compile_eager(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--env", "MIRAGE_COMPILE=eager", "--", "python", "-c", EAGER)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "eager_ok" in _lines(r.stdout)
    notice = ("mirage: torch.compile(backend='inductor') runs eagerly on the emulated GPUs (MIRAGE_COMPILE=eager: "
              "same results, nothing compiled); this notice is printed once")
    assert [line for line in _lines(r.stderr) if "torch.compile" in line] == [notice]


def test_an_unknown_mirage_compile_setting_is_named(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--env", "MIRAGE_COMPILE=fast", "--", "python", "-c", "import torch")
    assert r.returncode != 0
    assert ("mirage: MIRAGE_COMPILE='fast' is not a compile setting: use MIRAGE_COMPILE=eager to run "
            "torch.compile eagerly, or leave it unset to compile") in _lines(r.stderr), r.stderr[-2000:]


POINTWISE = r'''
import os
import torch

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
opt = torch.optim.SGD([w], lr=0.01)


def loss_of(x):
    # a chain of pointwise ops: eagerly each reads and writes 4 MB, fused once
    return ((x * w).sin() * 2 + x).tanh().mul(3).add(1).square().mean()


step = torch.compile(loss_of) if os.environ.get("COMPILED") == "1" else loss_of
for _ in range(4):
    step(torch.randn(1024, 1024, device="cuda")).backward()
    opt.step()
    opt.zero_grad()
print("pointwise_ok")
'''


def _clocked_step(tmp_path, compiled: str) -> tuple[float, set[str]]:
    """Predicted step time and the kernel names of a clocked run of POINTWISE, eager or compiled."""
    out = tmp_path / f"c{compiled}"
    out.mkdir()
    r = mirage_run(out, "--exec-mode", "clocked", "--env", f"COMPILED={compiled}", "--", "python", "-c", POINTWISE,
                   timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    report = json.loads((run / "report.json").read_text())
    trace = json.loads((run / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    return report["clocked"]["predicted_step_s"], names


@pytest.mark.compile  # in the compile set (.ci/run): it takes half a minute
def test_clocked_mode_prices_the_kernels_inductor_generated(tmp_path):
    eager_s, eager_names = _clocked_step(tmp_path, "0")
    compiled_s, compiled_names = _clocked_step(tmp_path, "1")
    fused = {n for n in compiled_names if n.startswith("fused_")}
    assert fused and not {n for n in eager_names if n.startswith("fused_")}, compiled_names
    assert "aten::sin" in eager_names and "aten::sin" not in compiled_names
    # fused, the chain moves its data once instead of once per op: cheaper, but not free (it is priced)
    assert 0.1 * eager_s < compiled_s < 0.7 * eager_s, (compiled_s, eager_s)


ATTENTION = r'''
import torch
import torch.nn.functional as F

torch.manual_seed(0)
q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)


@torch.compile
def attend(q):
    return F.scaled_dot_product_attention(q, q * 2, q, is_causal=True).float().square().mean()


for _ in range(2):
    attend(q).backward()
print("attention_ok")
'''


@pytest.mark.compile
def test_clocked_mode_prices_a_compiled_kernel_of_several_outputs(tmp_path):
    """SDPA in a compiled graph is one extern kernel of two outputs (the attention and its log-sum-exp, a
    ``MultiOutputLayout`` with no dtype of its own): priced once per call by the GPU flash attention's FLOPs, its
    outputs taken from it for free, its FLOPs those of the causal pass. torchtitan's compiled blocks stopped on it in clocked mode
    ("NotImplementedError: MultiOutputLayout")."""
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--", "python", "-c", ATTENTION, timeout=300)
    assert r.returncode == 0 and "[0] attention_ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    kernels = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    forward = [e for e in kernels if e["name"] == "extern__scaled_dot_product_flash_attention_for_cpu"]
    backward = [e for e in kernels if e["name"].startswith("extern__scaled_dot_product_flash_attention_for_cpu_backward")]
    assert len(forward) == 2 and len(backward) == 2, [e["name"] for e in kernels]
    # the GPU flash attention's FLOPs, not its bytes alone: causal, over the s·(s + 1) / 2 pairs it computes,
    # 4·d a pair forward and 10·d backward (shim/clock/attention.py), as the eager op is charged
    pairs = 128 * 129 // 2
    assert [e["args"]["flops"] for e in forward + backward] == [2 * 4 * pairs * 4 * 64] * 2 + [
        2 * 4 * pairs * 10 * 64] * 2, forward + backward
