"""Ops on emulated cuda tensors in C++ (shim/native/fast_dispatch.cpp, shim/tensor/fast_dispatch.py) and in Python.

One program describes views and other ops' results (values, geometry, the
wrapper's attributes, autograd's view metadata, gradients, the memory books,
errors, what a TorchDispatchMode sees, other threads) and is run twice: with
the C++ kernels, and without a compiler (every op through
``__torch_dispatch__``). The two descriptions must be the same.
"""

from __future__ import annotations

import pytest

from tests.test_run import mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")

_PROGRAM = r"""
import json, threading, torch
from torch.utils._python_dispatch import TorchDispatchMode
from shim.device import state as dev
from shim.tensor import fast_dispatch
from shim.tensor import wrapper as T

print("fast dispatch:", fast_dispatch.FAST_DISPATCH_ERROR)
calls = []
run = T.MirageTensor.__dict__["__torch_dispatch__"].__func__
def counted(cls, func, types, args=(), kwargs=None):
    calls.append(str(func))
    return run(cls, func, types, args, kwargs)
T.MirageTensor.__torch_dispatch__ = classmethod(counted)

def describe(t, base):
    src = base._src if base._src is not None else base
    return dict(type=type(t).__name__, shape=list(t.shape), stride=list(t.stride()), offset=t.storage_offset(),
                dtype=str(t.dtype), device=str(t.device), requires_grad=t.requires_grad, is_leaf=t.is_leaf,
                grad_fn=type(t.grad_fn).__name__ if t.grad_fn else None, is_view=t._is_view(),
                base=t._base is base or (t._base is not None and t._base is base._base), gpu=t._gpu,
                src=t._src is src, own_hold=bool(t._mem), keys=str(torch._C._dispatch_keys(t)),
                elem=[type(t._elem).__name__, list(t._elem.shape), list(t._elem.stride()), t._elem.storage_offset(),
                      t._elem.data_ptr() - base._elem.data_ptr(), t._elem._is_view()],
                values=str(t.tolist()))

def show(name, t, base):
    print(name, json.dumps(describe(t, base), sort_keys=True), flush=True)

x = torch.arange(24., device="cuda:1").reshape(2, 3, 4)
cases = {
    "view": lambda: x.view(6, 4), "view_dtype": lambda: x.view(torch.int32), "t": lambda: x[0].t(),
    "transpose": lambda: x.transpose(0, 2), "detach": lambda: x.detach(), "expand": lambda: x.expand(3, 2, 3, 4),
    "select": lambda: x.select(1, 2), "unsqueeze": lambda: x.unsqueeze(1), "squeeze_dim": lambda: x[:1].squeeze(0),
    "squeeze_dims": lambda: x[:1, :1].squeeze((0, 1)), "squeeze": lambda: x[:1].squeeze(),
    "permute": lambda: x.permute(2, 0, 1), "as_strided": lambda: x.as_strided((2, 2), (1, 2), 1),
    "slice": lambda: x[:, 1:3], "step": lambda: x[..., ::2], "alias": lambda: torch.ops.aten.alias(x),
    "diagonal": lambda: x.diagonal(0, 1, 2), "unfold": lambda: x.unfold(2, 2, 1), "narrow": lambda: x.narrow(2, 1, 2),
    "view_of_view": lambda: x[1].t().unsqueeze(0),
}
del calls[:]
for name, make in cases.items():
    show(name, make(), x)
print("calls:", len(calls))

def show_new(name, t):  # a wrapper of its own (another op's output): shim/tensor/wrapper.py's _new
    grad_fn = type(t.grad_fn).__name__ if t.grad_fn else None
    print(name, json.dumps(dict(type=type(t).__name__, shape=list(t.shape), stride=list(t.stride()),
                                offset=t.storage_offset(), dtype=str(t.dtype), device=str(t.device), gpu=t._gpu,
                                requires_grad=t.requires_grad, grad_fn=grad_fn, counted=bool(t._mem),
                                src=t._src is None, keys=str(torch._C._dispatch_keys(t)),
                                elem=[type(t._elem).__name__, list(t._elem.stride()), t._elem.storage_offset()],
                                values=str(t.tolist())), sort_keys=True), flush=True)

F = torch.nn.functional
cases = {
    "add": lambda: x + 1, "scalar_tensor": lambda: x * torch.tensor(2.0), "clone": lambda: x[:, 1:].clone(),
    "sum": lambda: x.sum(), "mean": lambda: x.mean(1, keepdim=True), "ones": lambda: torch.ones(3, device="cuda:1"),
    "empty": lambda: x[:0] * 2, "strided": lambda: torch.empty_strided((2, 3), (1, 2), device="cuda").fill_(2),
    "to": lambda: x.to(torch.int64), "matmul": lambda: x @ x.transpose(1, 2), "int": lambda: x.long() * 3,
    "half": lambda: x.half().softmax(-1), "complex": lambda: torch.view_as_complex(x[..., :2].contiguous()) * 1j,
    "grad": lambda: torch.ones(2, device="cuda", requires_grad=True) * 3, "layer_norm": lambda: F.layer_norm(x, (4,)),
}
for name, make in cases.items():
    show_new(name, make())
print("memory now", torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1))
for name, make in {"two_gpus": lambda: x + torch.ones(4, device="cuda:0"), "cpu": lambda: x + torch.ones(4),
                   "shapes": lambda: x.mm(x[0])}.items():
    try:
        make()
    except RuntimeError as e:
        print("error", name, e)
xl = x.clone().requires_grad_()
(F.layer_norm(xl, (4,)) * torch.arange(4.0, device="cuda:1")).sum().backward()  # undefined weight/bias grads
print("layer_norm grad", xl.grad.tolist())
with dev.allocating_on(0):
    show_new("allocating_on_plain", x * 2)
with torch.inference_mode():
    y = x * 2
    show_new("inference", y)
    show("inference_view", y.view(-1), y)
    print("is_inference", y.is_inference(), y.view(-1).is_inference())

w = torch.arange(24., device="cuda", requires_grad=True)
y = w.view(2, 3, 4).permute(2, 0, 1).unsqueeze(0).expand(2, 4, 2, 3).select(1, 3)
show("grad_view", y, w)
(y * torch.arange(12., device="cuda").view(2, 2, 3)).sum().backward()
print("grad", w.grad.tolist())

a = torch.zeros(4, 4, device="cuda")
b = a.t()
b[0].add_(1)  # through the views to the base's storage
print("inplace", a.tolist(), a._version, b._version)
leaf = torch.zeros(3, device="cuda", requires_grad=True)
try:
    leaf.view(3).add_(1)
except RuntimeError as e:
    print("leaf view in-place:", e)

seen = []
thread = threading.Thread(target=lambda: seen.append([describe(x.transpose(0, 1), x), (x * 2).tolist()]))
thread.start()
thread.join()
print("thread", json.dumps(seen, sort_keys=True))
with dev.allocating_on(0):
    show("allocating_on", x.view(-1), x)
try:
    x.transpose(0, 2).view(24)
except RuntimeError as e:
    print("error:", e)
z = torch.tensor([1 + 2j, 3 - 1j], device="cuda")
print("conj", z.conj().view(2, 1).tolist(), z.conj().view(2, 1).is_conj())

class Log(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))

row = x[0]
del seen[:]
with Log():
    show("under_mode", row.t().unsqueeze(0).detach(), x)
    show_new("plain_under_mode", row * 2)
print("mode saw", seen)

def in_place(name, op):  # each written through a view, to its base's storage
    base = torch.arange(12., device="cuda:1").reshape(3, 4)
    t, o = base[:, 1:], torch.linspace(1, 2, 9, device="cuda:1").reshape(3, 3)
    version = t._version
    del calls[:]
    r = op(t, o)
    in_python.extend(calls)
    print("in-place", name, r is t, t._version - version, t.tolist(), base.tolist(), flush=True)
in_python = []
longs = torch.full((3, 3), 2, dtype=torch.long, device="cuda:1")
for name, op in {
    "copy_": lambda t, o: t.copy_(o), "copy_cast": lambda t, o: t.copy_(longs),
    "copy_scalar": lambda t, o: t.copy_(torch.tensor(3.0)), "add_": lambda t, o: t.add_(o, alpha=2),
    "add_scalar": lambda t, o: t.add_(3), "sub_": lambda t, o: t.sub_(o), "mul_": lambda t, o: t.mul_(o),
    "mul_scalar": lambda t, o: t.mul_(0.5), "div_": lambda t, o: t.div_(o), "div_scalar": lambda t, o: t.div_(4),
    "zero_": lambda t, o: t.zero_(), "fill_": lambda t, o: t.fill_(7),
    "addcmul_": lambda t, o: t.addcmul_(o, o, value=0.5), "addcdiv_": lambda t, o: t.addcdiv_(o, o, value=-1),
    "lerp_": lambda t, o: t.lerp_(o, 0.25), "sqrt_": lambda t, o: t.sqrt_(), "clamp_": lambda t, o: t.clamp_(2, 5),
    "neg_": lambda t, o: t.neg_(),
}.items():
    in_place(name, op)
print("in-place calls:", len(in_python), in_python)
i = torch.ones(3, dtype=torch.long, device="cuda:1")
try:
    i.add_(torch.full((3,), 0.5, device="cuda:1"))
except RuntimeError as e:
    print("in-place error", e, i.tolist(), i._version)

def foreach(name, op):  # an optimizer's updates: each writes every tensor of its first list
    ts = [torch.arange(6., device="cuda:1").reshape(2, 3)[:, 1:], torch.full((4,), 3., device="cuda:1")]
    os = [torch.full((2, 2), 2., device="cuda:1"), torch.linspace(1, 2, 4, device="cuda:1")]
    versions = [t._version for t in ts]
    del calls[:]
    try:
        r = op(ts, os)
    except RuntimeError as e:
        r = f"error {e}"
    foreach_python.extend(calls)
    r = r if isinstance(r, str) else [a is b for a, b in zip(r, ts)]  # torch hands back the list it wrote
    print("foreach", name, r, [t._version - v for t, v in zip(ts, versions)], [t.tolist() for t in ts], flush=True)
foreach_python = []
half = torch.tensor(0.5, device="cuda:1")
for name, op in {
    "add_": lambda ts, os: torch._foreach_add_(ts, 2.0), "add_list": lambda ts, os: torch._foreach_add_(ts, os, alpha=-1),
    "add_scalars": lambda ts, os: torch._foreach_add_(ts, [1.0, 2.0]), "add_tensor": lambda ts, os: torch._foreach_add_(ts, half),
    "sub_": lambda ts, os: torch._foreach_sub_(ts, os), "mul_": lambda ts, os: torch._foreach_mul_(ts, 3.0),
    "mul_list": lambda ts, os: torch._foreach_mul_(ts, os), "mul_tensor": lambda ts, os: torch._foreach_mul_(ts, half),
    "div_scalars": lambda ts, os: torch._foreach_div_(ts, [2.0, 4.0]), "div_list": lambda ts, os: torch._foreach_div_(ts, os),
    "addcmul_": lambda ts, os: torch._foreach_addcmul_(ts, os, os, value=0.5),
    "addcdiv_scalars": lambda ts, os: torch._foreach_addcdiv_(ts, os, os, [0.1, -0.2]),
    "lerp_": lambda ts, os: torch._foreach_lerp_(ts, os, 0.25), "sqrt_": lambda ts, os: torch._foreach_sqrt_(ts),
    "neg_": lambda ts, os: torch._foreach_neg_(ts), "zero_": lambda ts, os: torch._foreach_zero_(ts),
    "lengths": lambda ts, os: torch._foreach_add_(ts, os[:1]),
}.items():
    foreach(name, op)
print("foreach calls:", len(foreach_python), foreach_python)
w = torch.ones(3, device="cuda:1", requires_grad=True)
saved = torch.full((3,), 2.0, device="cuda:1")
y = (w * saved).sum()
torch._foreach_mul_([saved], 3.0)  # what mul saved for backward, written in place
try:
    y.backward()
    print("foreach write seen by autograd: no")
except RuntimeError as e:
    print("foreach write seen by autograd:", str(e).split(":")[0])

# what the kernels may take: in-place, device-taking, random and list-returning ops stay in Python
for check, op in ((fast_dispatch._check_plain, torch.ops.aten.add_.Tensor),
                  (fast_dispatch._check_plain, torch.ops.aten.ones_like.default),
                  (fast_dispatch._check_plain, torch.ops.aten.bernoulli.p),
                  (fast_dispatch._check_plain, torch.ops.aten.view.default),
                  (fast_dispatch._check_view, torch.ops.aten.split.Tensor),
                  (fast_dispatch._check_in_place, torch.ops.aten.add.Tensor),
                  (fast_dispatch._check_in_place, torch.ops.aten._foreach_add_.Scalar)):
    try:
        check(op)
    except AssertionError as e:
        print("refused:", e)

base = torch.cuda.memory_allocated(1)
v = torch.ones(1024, device="cuda:1").view(32, 32).t()
grown = torch.cuda.memory_allocated(1) - base
del v
print("memory", grown, torch.cuda.memory_allocated(1) - base)
"""


def _describe(tmp_path, compiler: str) -> tuple[list[str], str, str]:
    env = [] if compiler == "c++" else ["--env", f"MIRAGE_CACHE_DIR={tmp_path / 'cache'}",
                                        "--env", "CXX=/nonexistent/c++"]
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "2", *env, "--", "python", "-c", _PROGRAM)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    [error] = [line for line in lines if line.startswith("[0] fast dispatch: ")]
    [calls] = [line for line in lines if line.startswith("[0] calls: ")]
    [in_place] = [line for line in lines if line.startswith("[0] in-place calls: ")]
    [foreach] = [line for line in lines if line.startswith("[0] foreach calls: ")]
    return ([line for line in lines if line not in (error, calls, in_place, foreach)], error,
            "; ".join((calls, in_place, foreach)))


def test_ops_in_cpp_describe_the_same_as_through_torch_dispatch(tmp_path):
    cpp, error, calls = _describe(tmp_path / "cpp", "c++")
    assert error == "[0] fast dispatch: None"
    # every view of the set stayed in C++ but one: view(dtype)'s autograd kernel detaches its input
    # through torch's Python interpreter (TensorImpl::shallow_copy_and_detach), not the dispatcher
    # and every in-place op did too (the copy of a 0-dim CPU tensor as well, a scalar as in _fast)
    # and every foreach op (autograd's kernel of a .Tensor overload reads the 0-dim tensor's value first)
    assert calls == ("[0] calls: 1; [0] in-place calls: 0 []; "
                     "[0] foreach calls: 1 ['aten._local_scalar_dense.default']"), calls
    python, error, calls = _describe(tmp_path / "python", "none")
    assert error == ("[0] fast dispatch: no C++ compiler: '/nonexistent/c++' not found (CXX names the compiler, "
                     "default c++)")
    assert calls.startswith("[0] calls: ") and "calls: 0" not in calls
    assert cpp == python
    text = "\n".join(cpp)
    # what both must say, beyond being the same
    # a view is counted through the wrapper that holds its storage, but one of a tensor in an autograd graph,
    # which counts its storage itself (a link to that wrapper could close a cycle the collector never sees)
    grad_view = next(line for line in cpp if line.startswith("[0] grad_view "))
    assert '"src": false' in grad_view and '"own_hold": true' in grad_view, grad_view
    assert all('"src": true' in line for line in cpp if line.startswith(("[0] view ", "[0] t ", "[0] select "))), text
    assert "[0] inplace [[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]] 1 1" in cpp
    assert any(line.startswith("[0] leaf view in-place: a view of a leaf Variable that requires grad") for line in cpp)
    assert any(line.startswith("[0] thread [[{") for line in cpp), text
    # written once, through the view, the same wrapper handed back
    assert ("[0] in-place add_ True 1 [[3.0, 4.25, 5.5], [7.75, 9.0, 10.25], [12.5, 13.75, 15.0]] "
            "[[0.0, 3.0, 4.25, 5.5], [4.0, 7.75, 9.0, 10.25], [8.0, 12.5, 13.75, 15.0]]") in cpp, text
    assert len([line for line in cpp if line.startswith("[0] in-place ") and " True 1 " in line]) == 18, text
    assert any(line.startswith("[0] in-place error result type Float can't be cast to the desired output type "
                               "Long [1, 1, 1] 0") for line in cpp), text
    # one write of each tensor counted, as the GPU's foreach kernels count it (autograd's in-place check reads it)
    assert ("[0] foreach add_list [True, True] [1, 1] [[[-1.0, 0.0], [2.0, 3.0]], [2.0, 1.6666666269302368, "
            "1.3333333730697632, 1.0]]") in cpp, text
    assert len([line for line in cpp if line.startswith("[0] foreach ") and " [True, True] [1, 1] " in line]) == 16, text
    assert any(line.startswith("[0] foreach lengths error ") and " [0, 0] " in line for line in cpp), text
    assert ("[0] foreach write seen by autograd: one of the variables needed for gradient computation has been "
            "modified by an inplace operation") in cpp, text
    assert '"gpu": 0' in next(line for line in cpp if line.startswith("[0] allocating_on "))
    assert '"gpu": 0' in next(line for line in cpp if line.startswith("[0] allocating_on_plain "))
    assert any(line.startswith("[0] error: view size is not compatible") for line in cpp), text
    assert ("[0] error two_gpus Expected all tensors to be on the same device, but found at least two devices, "
            "cuda:1 and cuda:0!") in cpp, text
    assert any(line.startswith("[0] error shapes ") for line in cpp), text
    assert ("[0] mode saw ['aten.t.default', 'aten.unsqueeze.default', 'aten.detach.default', "
            "'aten.mul.Tensor']") in cpp, text
    assert "[0] memory 4096 0" in cpp, text
    assert [line for line in cpp if line.startswith("[0] refused: ")] == [
        "[0] refused: aten.add_.Tensor is not a functional op on tensors and numbers",
        "[0] refused: aten.ones_like.default is not a functional op on tensors and numbers",
        "[0] refused: aten.bernoulli.p is not a functional op on tensors and numbers",
        "[0] refused: aten.view.default is not a functional op on tensors and numbers",
        "[0] refused: aten.split.Tensor is not a view of its one tensor argument returning one tensor",
        "[0] refused: aten.add.Tensor is not an in-place op on its first argument",
        "[0] refused: aten._foreach_add_.Scalar is not an in-place op on its first argument",
    ], text


def test_an_op_past_the_gpus_memory_raises_torchs_error_from_the_cpp_path(tmp_path):
    """The allocator refuses an output in C++ as in Python (the op then runs in Python, which raises it)."""
    program = ("import torch\n"
               "from shim.tensor import fast_dispatch\n"
               "assert fast_dispatch.FAST_DISPATCH_ERROR is None\n"
               "x = torch.zeros(40 << 20, dtype=torch.uint8, device='cuda')\n"
               "y = x + 1\n")
    r = mirage_run(tmp_path, "--in-process", "--hbm", "64MiB", "--", "python", "-c", program)
    assert r.returncode == 1
    assert ("[0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total "
            "capacity of 64.00 MiB of which 24.00 MiB is free.") in r.stderr, r.stderr[-2000:]


_CLOCKED = r"""
import hashlib, json, torch
from shim.clock import clock as C
from shim.rank.runtime import RUNTIME
from shim.tensor import fast_dispatch

print("fast dispatch:", fast_dispatch.FAST_DISPATCH_ERROR)
charge = C.Clock.charge  # __torch_dispatch__'s pricing (the C++ kernels hold Clock.charge_priced)
counts = {"python": 0}
def counted(self, *a):
    counts["python"] += 1
    return charge(self, *a)
C.Clock.charge = counted
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                            torch.nn.Linear(128, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
x, y = torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
a, b = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
for _ in range(2):  # x + x reads x once, x + y both: one signature would price both alike
    a + a, a + b, b * b, b * a
for step in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(torch.softmax(model(x) * 2.0, -1).log() + x[:, :10].abs().sqrt(), y)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
clk = RUNTIME.clock
kernels = [(e[1], e[2], e[3], e[4], e[5], json.dumps(e[6], sort_keys=True)) for e in clk.events if e[0] == "compute"]
print("kernels", len(kernels), hashlib.sha256(repr(kernels).encode()).hexdigest())
print("steps", [(s, round(a * 1e9), round(b * 1e9)) for s, a, b in clk.steps])
print("loss", round(loss.item(), 5), "priced in Python", counts["python"], "of", len(kernels))
"""


def _clocked(tmp_path, compiler: str) -> list[str]:
    env = [] if compiler == "c++" else ["--env", f"MIRAGE_CACHE_DIR={tmp_path / 'cache'}",
                                        "--env", "CXX=/nonexistent/c++"]
    r = mirage_run(tmp_path, "--exec-mode", "clocked", *env, "--", "python", "-c", _CLOCKED)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if line.startswith("[0] ")]


def test_clocked_mode_times_the_ops_in_cpp_as_python_does(tmp_path):
    """Clocked mode's plain ops, priced from the C++ table of costs, give the trace and the steps that
    pricing every op in Python gives, kernel for kernel."""
    cpp = _clocked(tmp_path / "cpp", "c++")
    python = _clocked(tmp_path / "python", "none")
    assert cpp[0] == "[0] fast dispatch: None"
    assert python[0].startswith("[0] fast dispatch: no C++ compiler")
    assert cpp[1:-1] == python[1:-1]
    loss, in_python, kernels = cpp[-1].split(" priced in Python ")[0], *map(int, cpp[-1].split()[-3::2])
    all_in_python = int(python[-1].split()[-3])
    assert python[-1] == f"{loss} priced in Python {all_in_python} of {kernels}"
    assert kernels > 50 and in_python < all_in_python / 2, (cpp[-1], python[-1])  # most ops in C++ here


_OPTIMIZER_STEP = r"""
import torch
from shim.tensor import wrapper as T

general = []
run = T._dispatch
def counted(func, plan, args, kwargs):
    general.append(str(func))
    return run(func, plan, args, kwargs)
T._dispatch = counted

def train(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(device)
    x = torch.randn(5, 8).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        del general[:]
        opt.zero_grad()
        torch.cat([model(x), model(x)]).square().mean().backward()
        opt.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        seen = list(general)
    return seen, [p.detach().cpu() for p in model.parameters()]

seen, gpu = train("cuda")
_, cpu = train("cpu")
print("general path:", seen)
print("equal:", all(torch.equal(a, b) for a, b in zip(gpu, cpu)))
"""


def test_an_optimizer_step_keeps_off_the_general_path(tmp_path):
    """A training step's ops with keyword arguments or tensor lists (autograd's ``ones_like(pin_memory=False)``,
    the foreach ops of SGD and ``clip_grad_norm_``, ``cat``) take the fast path of ``__torch_dispatch__``, not
    the general one (~5 us more each; docs/performance.md, "torch.compile"), and compute what the CPU does."""
    r = mirage_run(tmp_path, "--in-process", "--", "python", "-c", _OPTIMIZER_STEP)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] general path: []" in r.stdout, r.stdout
    assert "[0] equal: True" in r.stdout, r.stdout
