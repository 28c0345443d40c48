"""Triton kernels on the emulated GPUs (issue 28, Triton half): they run, without the user setting anything.

``import triton`` works as on a ROCm build; ``@triton.jit`` and ``@triton.autotune`` kernels launched on
``cuda`` tensors compute what torch computes on the CPU (Triton's interpreter over the emulated tensors'
host memory, shim/compile/triton_runtime.py); ``triton.runtime.driver.active`` answers as the profile's GPU; a
construct the interpreter cannot run fails with one line naming the kernel and the construct; in clocked mode a
launch takes its roofline time on the emulated timeline (shim/clock/triton_kernels.py). Real
``mirage run`` processes, no mocks; the programs are files, since Triton reads a kernel's source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shim.clock.roofline import FP16_GEMM_EFFICIENCY, KERNEL_LAUNCH_S, MEMORY_EFFICIENCY
from tests.test_run import FIXTURES, REPO_ROOT, mirage_run
from wire.profiles import load_profile

pytestmark = pytest.mark.usefixtures("no_orphans")

PROGRAM = r'''
import os
import triton  # before torch, as a kernels module may: its kernels are interpreted all the same
import triton.language as tl
from triton.language.extra.hip import libdevice as amd_libdevice
from triton.language.extra.libdevice import rsqrt, tanh


@triton.jit
def early_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


import torch


@triton.jit
def softmax_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=-float("inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_stride + cols, num / tl.sum(num, axis=0), mask=cols < n_cols)


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 128}, num_warps=8)],
                 key=["n"], reset_to_zero=["acc_ptr"])
@triton.jit
def norm_act_kernel(x_ptr, out_ptr, acc_ptr, n, eps, BLOCK: tl.constexpr):
    # libdevice math, a float argument used as a Triton scalar, an atomic the autotuner must reset
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tanh(x) * rsqrt(x * x + eps.to(tl.float32)) + amd_libdevice.erf(x) - tl.erf(x)
    tl.store(out_ptr + offs, y, mask=mask)
    tl.atomic_add(acc_ptr, tl.sum(tl.where(mask, y, 0.0), axis=0))


assert triton.__version__ == "3.7.1", triton.__version__
assert os.environ["TRITON_INTERPRET"] == "1"
torch.manual_seed(0)

# a vector add, into a view at an offset of a larger tensor (the kernel writes the emulated GPU's memory)
x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
big = torch.zeros(1100, device="cuda")
out = big[100:]
early_add[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
assert out.device == torch.device("cuda", 0) and torch.equal(out.cpu(), x.cpu() + y.cpu())
assert torch.equal(big[:100].cpu(), torch.zeros(100))
print("vector add ok")

# a masked row softmax (57 columns in 64-wide blocks), from a strided input into a fresh output
s = torch.randn(33, 80, device="cuda")[:, :57]
s_out = torch.empty(33, 57, device="cuda")
softmax_kernel[(33,)](s, s_out, s.stride(0), s_out.stride(0), 57, BLOCK=64)
assert torch.allclose(s_out.cpu(), torch.softmax(s.cpu(), dim=1), atol=1e-6)
print("softmax ok")

# autotuned: every config benchmarked on the host, the fastest kept, the result torch's
n = 1000
xa = torch.randn(n, device="cuda")
ya, acc = torch.empty(n, device="cuda"), torch.zeros(1, device="cuda")
norm_act_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](xa, ya, acc, n, 1e-6)
want = xa.cpu().tanh() * torch.rsqrt(xa.cpu() ** 2 + 1e-6)
assert torch.allclose(ya.cpu(), want, atol=1e-6)
assert torch.allclose(acc.cpu(), want.sum().reshape(1), atol=1e-3), (acc, want.sum())  # reset between configs
assert set(norm_act_kernel.configs_timings) == set(norm_act_kernel.configs)
# the config its host timings found fastest (which one that is depends on the machine's load at that moment:
# 8 programs of BLOCK 128 usually beat 32 of BLOCK 32, but a test must not bet on a timing)
timings = norm_act_kernel.configs_timings
assert norm_act_kernel.best_config == min(timings, key=timings.get), timings
print("autotune ok", norm_act_kernel.best_config.kwargs)

# the driver answers as the profile's GPU
from triton.language import target_info
from triton.runtime import driver

active = driver.active
target = active.get_current_target()
props = active.utils.get_device_properties(0)
print("target", target.backend, target.arch, target.warp_size)
print("properties", props["arch"], props["warpSize"], props["multiprocessor_count"], props["max_shared_mem"])
assert target_info.is_hip() and target_info.is_hip_cdna4() and not target_info.is_cuda()
assert active.get_active_torch_device() == torch.device("cuda", 0)
assert active.get_device_interface() is torch.cuda
import triton.testing
assert triton.testing.do_bench(lambda: early_add[(4,)](x, y, out, 1000, BLOCK=256), warmup=1, rep=3) > 0
assert triton.testing.get_dram_gbps() == 8000, triton.testing.get_dram_gbps()  # the profile's 8 TB/s
print("triton_ok")
'''

UNSUPPORTED = r'''
import torch
import triton
import triton.language as tl
from triton.language import core
from triton.language.extra.cuda import libdevice as nvidia_libdevice
from shim.compile.triton_runtime import UnsupportedTritonKernel


@triton.jit
def through_asm(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = tl.inline_asm_elementwise("v_mov_b32 $0, $1", "=v,v", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(out_ptr + offs, y, mask=offs < n)


@core.extern
def ocml_tanh(arg0, _semantic=None):  # an external device library's function, as libdevice modules define them
    return core.extern_elementwise("", "", [arg0], {(core.dtype("fp32"),): ("__ocml_tanh_f32", core.dtype("fp32"))},
                                   is_pure=True, _semantic=_semantic)


@triton.jit
def through_extern(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, ocml_tanh(x), mask=offs < n)


@triton.jit
def through_nvidia(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, nvidia_libdevice.tanh(x), mask=offs < n)


x = torch.randn(10, device="cuda")
out = torch.full((10,), 7.0, device="cuda")
for kernel in (through_extern, through_nvidia):
    try:
        kernel[(1,)](x, out, 10, BLOCK=16)
    except UnsupportedTritonKernel as e:
        print("caught:", e)
assert torch.equal(out.cpu(), torch.full((10,), 7.0))  # nothing written
through_asm[(1,)](x, out, 10, BLOCK=16)
print("not reached")
'''

TWO_RANKS = r'''
import os
import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
torch.manual_seed(rank)
x = torch.randn(300, device=f"cuda:{rank}")
out = torch.empty_like(x)
scale_kernel[(triton.cdiv(300, 128),)](x, out, 300, float(rank + 1), BLOCK=128)
assert out.device == torch.device("cuda", rank)
assert triton.runtime.driver.active.get_active_torch_device() == torch.device("cuda", rank)
assert torch.equal(out.cpu(), x.cpu() * (rank + 1))
dist.all_reduce(out)  # the kernel's output goes on through the collectives
print(f"rank {rank} kernel ok on {out.device}, sum {out.sum().item():.4f}")
dist.destroy_process_group()
'''

COMPILED = r'''
import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})], key=["n"])
@triton.jit
def add_tuned(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@torch.compile
def jitted(x, y):
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(x.numel(), 64),)](x, y, out, x.numel(), BLOCK=64)
    return out.sin()


@torch.compile
def tuned(x, y):
    out = torch.empty_like(x)
    add_tuned[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, out, x.numel())
    return out.cos() * 2


x, y = torch.randn(100, device="cuda"), torch.randn(100, device="cuda")
for f, want in ((jitted, (x.cpu() + y.cpu()).sin()), (tuned, (x.cpu() + y.cpu()).cos() * 2)):
    got = f(x, y)
    assert got.device == torch.device("cuda", 0) and torch.allclose(got.cpu(), want, atol=1e-6), (got, want)
print("compiled_ok")
'''

LIGER = r'''
import time
import torch
import torch.nn.functional as F
from liger_kernel.transformers import LigerCrossEntropyLoss, LigerRMSNorm

torch.manual_seed(0)
h = torch.randn(2, 16, 64, device="cuda")
norm = LigerRMSNorm(64).to("cuda")
ref = torch.nn.RMSNorm(64, eps=norm.variance_epsilon)
a, b = h.clone().requires_grad_(), h.cpu().clone().requires_grad_()
start = time.perf_counter()
norm(a).square().sum().backward()
print(f"rms_norm forward+backward {1e3 * (time.perf_counter() - start):.0f} ms")
ref(b).square().sum().backward()
assert torch.allclose(norm(a).cpu(), ref(b), atol=1e-5)
assert torch.allclose(a.grad.cpu(), b.grad, atol=1e-4)
assert torch.allclose(norm.weight.grad.cpu(), ref.weight.grad, atol=1e-3)

logits, target = torch.randn(32, 500, device="cuda"), torch.randint(0, 500, (32,), device="cuda")
a, b = logits.clone().requires_grad_(), logits.cpu().clone().requires_grad_()
loss = LigerCrossEntropyLoss()(a, target)
loss.backward()
want = F.cross_entropy(b, target.cpu())
want.backward()
assert torch.allclose(loss.cpu(), want, atol=1e-5) and torch.allclose(a.grad.cpu(), b.grad, atol=1e-6)
print("liger_ok")
'''



def _program(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _rank_lines(stdout: str) -> list[str]:
    return [line.removeprefix("[0] ") for line in stdout.splitlines()]


def test_triton_kernels_run_on_emulated_gpus_as_on_the_profiles_gpu(tmp_path):
    r = mirage_run(tmp_path / "runs", "--in-process", "--", "python", _program(tmp_path, "prog.py", PROGRAM))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _rank_lines(r.stdout)
    assert "triton_ok" in lines, r.stdout[-3000:]
    assert "target hip gfx950 64" in lines
    assert "properties gfx950:sramecc+:xnack- 64 256 163840" in lines


def test_triton_driver_follows_the_profile(tmp_path):
    prog = _program(tmp_path, "arch.py", "import triton, torch\nt = triton.runtime.driver.active.get_current_target()\n"
                                         "print('target', t.arch, t.warp_size)\n")
    r = mirage_run(tmp_path / "runs", "--in-process", "--profile", "mi300x", "--", "python", prog)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "target gfx942 64" in _rank_lines(r.stdout)


def test_a_construct_the_interpreter_cannot_run_fails_in_one_line(tmp_path):
    r = mirage_run(tmp_path / "runs", "--in-process", "--", "python", _program(tmp_path, "bad.py", UNSUPPORTED),
                   timeout=120)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _rank_lines(r.stdout)
    tail = ", which the emulated GPU cannot run: its Triton kernels run in Triton's interpreter on the host"
    assert ("caught: mirage: Triton kernel 'through_extern' (bad.py:28) uses __main__.ocml_tanh (a builtin the "
            "interpreter does not provide, such as an external device library's)" + tail) in lines, r.stdout[-3000:]
    assert ("caught: mirage: Triton kernel 'through_nvidia' (bad.py:35) uses triton.language.extra.cuda.libdevice.tanh"
            " (NVIDIA's device library, which an AMD GPU does not have)" + tail) in lines, r.stdout[-3000:]
    assert "not reached" not in lines
    errors = [line.removeprefix("[0] ") for line in r.stderr.splitlines() if line.startswith("[0] ")]
    assert errors[-1] == (
        "shim.compile.triton_runtime.UnsupportedTritonKernel: mirage: Triton kernel 'through_asm' (bad.py:14) uses "
        "tl.inline_asm_elementwise (inline assembly), which the emulated GPU cannot run: its Triton kernels run "
        "in Triton's interpreter on the host"), r.stderr[-3000:]
    assert "InterpreterError" not in r.stderr  # one error, not the interpreter's chain


def test_two_ranks_each_run_a_kernel_on_their_own_gpu(tmp_path):
    r = mirage_run(tmp_path / "runs", "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   _program(tmp_path, "ranks.py", TWO_RANKS))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(2):
        assert any(line.startswith(f"[{rank}] rank {rank} kernel ok on cuda:{rank}, sum ")
                   for line in r.stdout.splitlines()), r.stdout
    # both ranks all-reduced the same tensor
    sums = {line.rsplit(" ", 1)[1] for line in r.stdout.splitlines() if " kernel ok on " in line}
    assert len(sums) == 1, r.stdout


def test_triton_kernels_inside_torch_compile_run_in_the_interpreter(tmp_path):
    """A kernel launched inside a compiled function runs eagerly there (a graph break), jit'd or autotuned."""
    r = mirage_run(tmp_path / "runs", "--in-process", "--", "python", _program(tmp_path, "comp.py", COMPILED))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compiled_ok" in _rank_lines(r.stdout), r.stdout[-3000:]


def test_clocked_mode_prices_a_triton_launch_by_its_bytes_and_dots(tmp_path):
    """A launch is a kernel on the emulated timeline: its bytes over HBM, its dots at the matrix rate, the launch."""
    r = mirage_run(tmp_path / "runs", "--exec-mode", "clocked", "--", "python", str(FIXTURES / "triton_clocked.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _rank_lines(r.stdout)
    assert "triton_clocked_ok" in lines, r.stdout[-3000:]
    us = {tuple(line.split()[:-2]): float(line.split()[-2]) for line in lines if line.endswith(" us")}  # 4 places
    mi350x = load_profile("mi350x")
    launch_us = KERNEL_LAUNCH_S * 1e6
    per_byte_us = 1e6 / (mi350x.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)
    # x and y read, out written, 4 bytes each, over the n lanes the masks leave on (not the grid's 31 x 32768)
    assert us["add", "1000000"] == pytest.approx(3 * 1_000_000 * 4 * per_byte_us + launch_us, abs=1e-4)
    assert us["add", "2000000"] - launch_us == pytest.approx(2 * (us["add", "1000000"] - launch_us), abs=2e-4)
    # autotuned: the chosen config's launch alone; the benchmarking of both configs is the host's
    assert us["tuned", "1000000"] == us["add", "1000000"] and us["tuned", "2000000"] == us["add", "2000000"]
    # a 1024 x 1024 x 2048 fp16 tl.dot: 2·M·N·K at the fp16 matrix rate, more than its 10 MiB take
    flops = 2 * 1024 * 1024 * 2048
    assert us["matmul",] == pytest.approx(flops / (mi350x.fp16_tflops * 1e6 * FP16_GEMM_EFFICIENCY) + launch_us,
                                          abs=1e-4)
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    trace = json.loads((run / "trace.json").read_text())
    kernels = [(e["name"], e["args"]["bytes"], e["args"]["flops"], e["args"]["bound"]) for e in trace["traceEvents"]
               if e.get("ph") == "X" and not e["name"].startswith(("aten::", "Memcpy"))]
    assert kernels == [
        ("add_kernel", 12_000_000, 0, "bytes-only"), ("add_tuned", 12_000_000, 0, "bytes-only"),
        ("add_kernel", 24_000_000, 0, "bytes-only"), ("add_tuned", 24_000_000, 0, "bytes-only"),
        ("matmul_kernel", (2 * 1024 * 2048 + 1024 * 1024) * 2, flops, "compute"),
        # what a block pointer's and a descriptor's boundaries leave on, read and written; an atomic's lane
        # reads and writes its element after its load
        ("block_copy", 2 * 100 * 60 * 4, 0, "bytes-only"), ("desc_copy", 2 * 128 * 64 * 4, 0, "bytes-only"),
        ("atomic_sum", 1000 * 4 + 2 * 1000 * 4, 0, "bytes-only")], kernels


@pytest.mark.compile  # in the compile set (.ci/run): it takes half a minute
def test_liger_kernels_match_torch(tmp_path):
    pytest.importorskip("liger_kernel")
    r = mirage_run(tmp_path / "runs", "--in-process", "--", "python", _program(tmp_path, "liger.py", LIGER))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "liger_ok" in _rank_lines(r.stdout), r.stdout[-3000:]


def test_importing_triton_changes_nothing_for_torch_outside_mirage(tmp_path):
    """Installed as a dependency, Triton must leave a plain process's torch as it was: no GPU, inductor's C++."""
    prog = ("import triton, torch, torch.utils._triton as t\n"
            "from torch._inductor import metrics\n"
            "print(torch.cuda.is_available(), t.has_triton(), 'TRITON_INTERPRET' in __import__('os').environ)\n"
            "f = torch.compile(lambda x: x.sin() + 1)\n"
            "x = torch.randn(8)\n"
            # inductor's vectorized sin differs from eager's by an ulp: near sin(x) = -1 that is no relative bound
            "print(torch.allclose(f(x), x.sin() + 1, atol=1e-6), metrics.generated_kernel_count > 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRAGE_", "TRITON_"))}
    # inductor generates the kernel (the FX graph and AOTAutograd caches off: not a graph a run before cached), and
    # the C++ compiler's build of it comes from the default cache dir, as any plain process's would: a fresh dir
    # per run (a tmp_path) rebuilt the kernel and inductor's own helpers every time, ten seconds of a 2-core box
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    r = subprocess.run([sys.executable, "-c", prog], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["False False False", "True True"], r.stdout + r.stderr[-3000:]
