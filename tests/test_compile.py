"""``torch.compile`` on the emulated GPUs (issue 15, item 4): every form runs, eagerly, with one notice.

Libraries define compiled functions at import (torchtitan's flex attention,
DeepSpeed's Muon optimizer), and ROCm users call ``torch.compile(model)`` with
the default backend: none of it may raise, every result must be the eager
one, and the program is told once, on stderr, that it runs eagerly. One real
``mirage run --in-process`` process, no mocks.
"""

from __future__ import annotations

import pytest

from tests.test_run import mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")

PROGRAM = r'''
import torch
import torch._dynamo

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).cuda()
x = torch.randn(5, 8, device="cuda")
want = model(x)


@torch.compile  # at definition, as libraries do at import
def double(t):
    return t * 2


@torch.compile(fullgraph=True, dynamic=True, mode="max-autotune")
def plus_one(t):
    return t + 1


compiled = torch.compile(model)
assert torch.equal(compiled(x), want)
assert torch.equal(double(x), x * 2) and torch.equal(plus_one(x), x + 1)
for backend in ("inductor", "aot_eager", "eager", lambda gm, inputs: gm):
    assert torch.equal(torch.compile(model, backend=backend)(x), want)
assert torch.equal(torch.compile(lambda t: t.sin(), fullgraph=True, dynamic=False)(x), x.sin())
try:
    torch.compile(model, mode="default", options={"max_autotune": True})
except RuntimeError as e:
    print("mode and options:", e)

# a training step through the compiled module: the same gradients as eager
compiled(x).square().sum().backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
model(x).square().sum().backward()
assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))

model.compile()  # nn.Module.compile
assert torch.equal(model(x), want)

# what libraries touch around torch.compile
torch._dynamo.config.cache_size_limit = 64
torch._dynamo.config.suppress_errors = True
assert torch.compiler.is_compiling() is False


@torch.compiler.disable
def minus_one(t):
    return t - 1


assert torch.equal(minus_one(x), x - 1)
assert torch.equal(torch._dynamo.disable(lambda t: t * 3)(x), x * 3)
torch._dynamo.mark_dynamic(x, 0)
with torch._dynamo.config.patch(capture_scalar_outputs=True):
    assert torch.equal(double(x), x * 2)
torch._dynamo.reset()
torch.compiler.reset()
print("compile_ok")
'''


def test_every_form_of_torch_compile_runs_eagerly_with_one_notice(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--", "python", "-c", PROGRAM)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line.removeprefix("[0] ") for line in r.stdout.splitlines()]
    assert "compile_ok" in lines, r.stdout[-3000:]
    assert "mode and options: Either mode or options can be specified, but both can't be specified at the same time." \
        in lines
    notice = ("mirage: torch.compile(backend='inductor') runs eagerly on the emulated GPUs (same results, no "
              "compilation: dynamo cannot trace the emulated tensors); this notice is printed once")
    assert [line.removeprefix("[0] ") for line in r.stderr.splitlines() if "torch.compile" in line] == [notice]
