"""A fast slice of the OpInfo parity run (bench/opinfo_parity.py): representative ops match the CPU.

The same driver and comparison as the full run (docs/fidelity.md): the ops'
sample inputs on emulated cuda inside ``mirage run --in-process``, against the
CPU: forward, backward, in-place and out= variants. Plus the answers about a
cuda tensor that a value comparison cannot see (errors, storage, in-place
geometry).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Elementwise, reductions, matmuls, nn layers and losses, indexing, views, factories with
#: data-dependent sizes (arange/linspace fill a resized out tensor), in-place resizes,
#: random ops (compared by shape and reproducibility), uninitialised outputs, and ops whose
#: results are not tensors (item, unique's counts).
OPS = [
    "abs", "add", "mul", "div.floor_rounding", "pow", "exp", "tanh", "clamp", "where", "masked_fill",
    "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum",
    "sum", "mean", "std", "var", "norm", "max.reduction_with_dim", "argmax", "cumsum", "topk", "sort", "unique",
    "nn.functional.linear", "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.cross_entropy",
    "nn.functional.gelu", "nn.functional.embedding", "softmax", "nn.functional.dropout",
    "cat", "stack", "index_select", "gather", "scatter", "index_put", "nonzero", "transpose", "reshape",
    "permute", "expand", "tril", "flip",
    "arange", "linspace", "resize_", "empty_like", "normal", "bernoulli", "item", "new_full",
]


#: Failures the slice expects, each explained in docs/fidelity.md ("Remaining failures"); a fix
#: makes the test fail until the entry is removed, so the list cannot go stale.
KNOWN_FAILURES = {
    ("matmul", "out"),  # out= with folded batch dims: views of one storage are not C++ aliases
}


def _parity():
    spec = importlib.util.spec_from_file_location("opinfo_parity", REPO_ROOT / "bench" / "opinfo_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_representative_ops_match_cpu(tmp_path):
    parity = _parity()
    rows = parity.run(OPS, log_dir=str(tmp_path))
    assert sorted(r["op"] for r in rows) == sorted(OPS)
    failures = {(r["op"], phase): r[phase + "_error"]
                for r in rows for phase in parity.PHASES if r.get(phase) == "failed"}
    unexpected = [f"{op} {phase}: {err}" for (op, phase), err in failures.items() if (op, phase) not in KNOWN_FAILURES]
    assert not unexpected, "\n".join(unexpected)
    assert set(failures) == KNOWN_FAILURES, f"fixed, remove from KNOWN_FAILURES: {KNOWN_FAILURES - set(failures)}"
    summary = parity.summarize(rows)["float32"]
    assert summary["forward"]["attempted"] >= len(OPS) - 2  # bool/int-only ops run in another dtype
    assert summary["backward"]["attempted"] >= 30


#: What the parity run cannot see (it compares values): answers a GPU build gives for cuda tensors.
SURFACE = """
import torch
x = torch.ones(3, 4, device="cuda")
try:
    x.numpy()
except TypeError as e:
    print("numpy:", e)
print("storage:", x.untyped_storage().device, x[1].data_ptr() - x.data_ptr())
w = torch.randn(2, 2, device="cuda")
w.t_()
print("t_:", w.stride())
r = torch.zeros(3, device="cuda")
same = r.resize_(2, 3) is r
print("resize_:", same, tuple(r.shape))
print("neg view:", (torch._neg_view(torch.ones(2, device="cuda")) + 0).tolist())
print("tril_indices:", torch.tril_indices(2, 2, device="cuda").device)
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._foreach_utils import _has_foreach_support
p = torch.nn.Parameter(torch.ones(3, device="cuda"))
print("foreach:", _default_to_fused_or_foreach([p], False, False), _has_foreach_support([p], p.device))
"""


@pytest.mark.slow
def test_cuda_tensor_surface(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    r = subprocess.run([sys.executable, "-m", "mirage_tui", "run", "--in-process", "--log-dir", str(tmp_path), "--",
                        sys.executable, "-c", SURFACE], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.removeprefix("[0] ") for line in r.stdout.splitlines()]
    assert ("numpy: can't convert cuda:0 device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first.") in lines
    assert "storage: cuda:0 16" in lines
    assert "t_: (1, 2)" in lines
    assert "resize_: True (2, 3)" in lines
    assert "neg view: [-1.0, -1.0]" in lines
    assert "tril_indices: cuda:0" in lines
    assert "foreach: (False, True) True" in lines  # optimizers default to foreach, as for GPU tensors


#: A fast slice of the autocast parity run (``bench/opinfo_parity.py --autocast``, docs/fidelity.md): ops of
#: every CUDA autocast policy (lower precision, float32, dtype set to float32, norm's float32 overload,
#: promote, refused) and ops autocast leaves alone, compared with CUDA's policy applied by hand on the CPU.
AUTOCAST_OPS = [
    "nn.functional.cross_entropy", "softmax", "log_softmax", "nn.functional.nll_loss", "nn.functional.linear",
    "matmul", "addmm", "nn.functional.conv2d", "nn.functional.layer_norm", "exp", "sum", "cumsum", "norm",
    "addcmul", "nn.functional.binary_cross_entropy", "add", "nn.functional.gelu",
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_autocast_representative_ops_match_cudas_policy_on_the_cpu(tmp_path, mode):
    parity = _parity()
    rows = parity.run(AUTOCAST_OPS, log_dir=str(tmp_path), autocast=mode)
    assert sorted(r["op"] for r in rows) == sorted(AUTOCAST_OPS)
    failures = [f"{r['op']} {phase}: {r[phase + '_error']}" for r in rows for phase in parity.PHASES
                if r.get(phase) == "failed"]
    assert not failures, "\n".join(failures)
    summary = parity.summarize(rows)["float32"]
    assert summary["backward"]["attempted"] >= len(AUTOCAST_OPS) - 3


def test_autocast_op_lists_are_cudas():
    """shim/device/autocast.py's lists name exactly the ops torch registers AutocastCUDA kernels for."""
    import torch

    from shim.device import autocast

    listed = {*autocast.LOWER_PRECISION_FP, *autocast.FP32, *autocast.FP32_SET_OPT_DTYPE, *autocast.PROMOTE,
              *autocast.BANNED, *(name for name, _, _ in autocast.APPEND_DTYPE)}
    listed = {n if "." in n else n + ".default" for n in listed}
    cuda = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA"):
            short = name.removeprefix("aten::")
            cuda.add(short if "." in short else short + ".default")
    # cuDNN's convolutions never run on a ROCm build (MIOpen's do, which autocast reaches through convolution)
    assert listed == cuda - {"cudnn_convolution.default", "cudnn_convolution_transpose.default"}


AUTOCAST_PROGRAM = r"""
import importlib.util
import torch
import torch.nn.functional as F

# the reference: CUDA's autocast policy applied by hand to CPU autocast (as bench/opinfo_parity.py --autocast)
spec = importlib.util.spec_from_file_location("opinfo_parity", "bench/opinfo_parity.py")
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)
parity.use_cuda_policy_on_cpu()


def losses(x, target, probs, weight, device):
    h = x @ torch.eye(5, device=device)  # a lower-precision op: the losses get the autocast dtype
    return {
        "cross_entropy": F.cross_entropy(h, target),
        "label_smoothing": F.cross_entropy(h, target, label_smoothing=0.1),
        "ignore_index": F.cross_entropy(h, target, ignore_index=int(target[0])),
        "weight": F.cross_entropy(h, target, weight=weight),
        "probabilities": F.cross_entropy(h, probs),
        "all options": F.cross_entropy(h, target, weight=weight, ignore_index=int(target[1]), label_smoothing=0.2),
        "nll_loss": F.nll_loss(F.log_softmax(h, 1), target),
        "softmax dtype positional": torch.softmax(h, 1, torch.float64),
        "softmax dtype keyword": torch.softmax(h, 1, dtype=torch.float64),
        "log_softmax dtype positional": torch.log_softmax(h, 1, torch.float64),
        "log_softmax dtype keyword": F.log_softmax(h, 1, dtype=torch.float64),
        "softmax": torch.softmax(h, 1),
        "lower": h,
    }


torch.manual_seed(0)
inputs = [torch.randn(8, 5), torch.randint(0, 5, (8,)), torch.softmax(torch.randn(8, 5), 1), torch.rand(5)]
for dtype in (torch.float16, torch.bfloat16):
    cpu = [t.clone() for t in inputs]
    cpu[0].requires_grad_()
    cuda = [t.cuda() for t in inputs]
    cuda[0].requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        want = losses(*cpu, "cpu")
    with torch.autocast("cuda", dtype=dtype):
        got = losses(*cuda, "cuda")
    assert got["lower"].dtype == dtype and got["softmax"].dtype == torch.float32
    assert got["softmax dtype positional"].dtype == got["log_softmax dtype keyword"].dtype == torch.float64
    for name in want:
        assert got[name].device.type == "cuda" and got[name].dtype == want[name].dtype, (name, got[name].dtype)
        assert torch.equal(got[name].detach().cpu(), want[name].detach()), (name, got[name], want[name])
        if got[name].dim() == 0:
            (g,) = torch.autograd.grad(got[name], cuda[0], retain_graph=True)  # h is shared
            (w,) = torch.autograd.grad(want[name], cpu[0], retain_graph=True)
            assert g.dtype == torch.float32 and torch.equal(g.cpu(), w), name
    print(f"{dtype} losses ok")

# AMP training on one GPU: float16 with a GradScaler, bfloat16 without; the loss must fall
for dtype, scaled in ((torch.float16, True), (torch.bfloat16, False)):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cuda", enabled=scaled)
    data = torch.randn(64, 16, device="cuda")
    labels = (data[:, :4].argmax(1)).cuda()
    first = None
    for step in range(60):
        with torch.autocast("cuda", dtype=dtype):
            logits = model(data)
            assert logits.dtype == dtype
            loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        first = loss.item() if first is None else first
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert loss.item() < 0.6 * first, (dtype, first, loss.item())
    print(f"amp {dtype} scaled={scaled}: {first:.3f} -> {loss.item():.3f}")
print("autocast_ok")
"""


@pytest.mark.slow
def test_autocast_losses_softmax_dtype_and_amp_training(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    r = subprocess.run([sys.executable, "-m", "mirage_tui", "run", "--in-process", "--log-dir", str(tmp_path), "--",
                        sys.executable, "-c", AUTOCAST_PROGRAM], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line.removeprefix("[0] ") for line in r.stdout.splitlines()]
    assert "torch.float16 losses ok" in lines and "torch.bfloat16 losses ok" in lines, r.stdout
    assert "autocast_ok" in lines
