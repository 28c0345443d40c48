"""Triton kernels on emulated GPUs (Triton's interpreter) vs the same computation in eager torch, in one run.

    python bench/triton_speed.py [--rounds R] [--json out.json]

Times three ``@triton.jit`` kernels of the Triton tutorials' kinds — a vector
add (1M fp32, 1024-wide blocks), a row softmax (512 x 1024 fp32, one program
per row) and a matmul (256 x 256 x 256 fp32, 64 x 64 x 32 tiles) — and, where
``liger-kernel`` is installed, Liger's RMSNorm and cross-entropy (forward and
backward), four ways:

- ``triton emulated``: the kernel on ``cuda`` tensors inside
  ``mirage run --in-process`` (shim/compile/triton_runtime.py: Triton's interpreter
  over the emulated tensors' host memory);
- ``triton native``: the kernel on CPU tensors in a plain process with
  ``TRITON_INTERPRET=1`` (Triton's interpreter as it ships, copying each
  argument's storage in and out);
- ``torch emulated`` and ``torch native``: the same computation in eager torch
  (``x + y``, ``softmax``, ``a @ b``, the unfused torch modules) on ``cuda``
  under mirage and on the CPU in the plain process.

Each figure is the best of R timed calls, one thread, after a warm-up call.
The driver prints ms per call and the ratios: the interpreter against eager
torch on the CPU (what a kernel costs on an emulated GPU compared with the
program without it), and emulated against native interpreter (what the shim
adds or saves).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("vector add", "softmax", "matmul", "liger rms_norm", "liger cross_entropy")


def kernels():
    """The Triton kernels (defined inside a function: ``@triton.jit`` decides interpreter-or-not as it decorates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    @triton.jit
    def softmax_kernel(x_ptr, out_ptr, stride, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
        num = tl.exp(x - tl.max(x, axis=0))
        tl.store(out_ptr + row * stride + cols, num / tl.sum(num, axis=0), mask=cols < n_cols)

    @triton.jit
    def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak,
                        mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
            b = tl.load(b_ptr + (k + rk)[:, None] * sbk + rn[None, :] * sbn,
                        mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return add_kernel, softmax_kernel, matmul_kernel


def cases(device: str) -> dict:
    """name -> (triton call, torch call, check) on ``device``; Liger's only where it is installed."""
    import torch
    import triton

    add_kernel, softmax_kernel, matmul_kernel = kernels()
    torch.manual_seed(0)
    x, y = torch.randn(1 << 20, device=device), torch.randn(1 << 20, device=device)
    out = torch.empty_like(x)
    s = torch.randn(512, 1024, device=device)
    s_out = torch.empty_like(s)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    c = torch.empty(256, 256, device=device)
    found = {
        "vector add": (lambda: add_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024),
                       lambda: x + y, lambda: torch.allclose(out, x + y)),
        "softmax": (lambda: softmax_kernel[(s.shape[0],)](s, s_out, s.stride(0), s.shape[1], BLOCK=1024),
                    lambda: torch.softmax(s, dim=1), lambda: torch.allclose(s_out, torch.softmax(s, dim=1), atol=1e-6)),
        "matmul": (lambda: matmul_kernel[(4, 4)](a, b, c, 256, 256, 256, *a.stride(), *b.stride(), *c.stride(),
                                                  BM=64, BN=64, BK=32),
                   lambda: a @ b, lambda: torch.allclose(c, a @ b, atol=1e-3, rtol=1e-4)),
    }
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerRMSNorm
    except ImportError:
        return found
    h = torch.randn(8, 128, 1024, device=device)
    liger_norm = LigerRMSNorm(1024).to(device)
    torch_norm = torch.nn.RMSNorm(1024, eps=liger_norm.variance_epsilon).to(device)
    logits = torch.randn(512, 8192, device=device)
    target = torch.randint(0, 8192, (512,), device=device)
    liger_ce, torch_ce = LigerCrossEntropyLoss(), torch.nn.CrossEntropyLoss()

    def fresh(t):  # Liger's cross-entropy writes its gradient into its input: every call gets its own
        return t.clone().requires_grad_()

    found["liger rms_norm"] = (lambda: liger_norm(fresh(h)).sum().backward(),
                               lambda: torch_norm(fresh(h)).sum().backward(),
                               lambda: torch.allclose(liger_norm(h), torch_norm(h), atol=1e-5))
    found["liger cross_entropy"] = (lambda: liger_ce(fresh(logits), target).backward(),
                                    lambda: torch_ce(fresh(logits), target).backward(),
                                    lambda: torch.allclose(liger_ce(fresh(logits), target), torch_ce(logits, target)))
    return found


def best(call, rounds: int) -> float:
    """Best of ``rounds`` calls after one warm-up, in ms."""
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def worker(kind: str, rounds: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    device = "cuda" if kind == "emulated" else "cpu"
    if kind == "emulated" and "shim.activate" not in sys.modules:
        raise SystemExit("triton_speed --worker emulated must run inside mirage run")
    rows = {}
    for name, (triton_call, torch_call, check) in cases(device).items():
        try:
            rows[f"{name}|triton {kind}"] = best(triton_call, rounds)
        except Exception as e:  # noqa: BLE001 - reported in the table instead of a figure
            # natively, Triton's stock interpreter cannot call libdevice (Liger's rsqrt, tanh): its stubs return None
            rows[f"{name}|triton {kind}"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"
        else:
            if not check():
                raise SystemExit(f"triton_speed: {name} on {device} computed other values than torch")
        rows[f"{name}|torch {kind}"] = best(torch_call, rounds)
    with open(out, "w") as f:
        json.dump(rows, f)


def main() -> None:
    """The driver: both workers, then the table and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed calls per figure (the best is kept)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--worker", choices=("emulated", "native"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker(ns.worker, ns.rounds, ns.out)
        return
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        me = [sys.executable, str(Path(__file__).resolve()), "--rounds", str(ns.rounds)]
        runs = {
            "emulated": ([sys.executable, "-m", "mirage_tui", "run", "--in-process", "--log-dir",
                          os.path.join(tmp, "runs"), "--", *me, "--worker", "emulated"], env),
            "native": ([*me, "--worker", "native"], dict(env, TRITON_INTERPRET="1")),
        }
        for kind, (cmd, kind_env) in runs.items():
            out = os.path.join(tmp, f"{kind}.json")
            r = subprocess.run([*cmd, "--out", out], cwd=ROOT, env=kind_env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"triton_speed: the {kind} worker failed:\n{(r.stdout + r.stderr)[-2000:]}")
            with open(out) as f:
                rows.update(json.load(f))
    cols = ("triton emulated", "triton native", "torch emulated", "torch native")
    print(f"{'kernel':>20} " + " ".join(f"{c:>15}" for c in cols) +
          " | triton emulated / torch native | triton emulated / triton native")
    for name in KERNELS:
        fig = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(name + "|")}
        if not fig:
            continue
        cells = " ".join(f"{fig[c]:>12.2f} ms" if isinstance(fig[c], float) else f"{'n/a':>15}" for c in cols)
        vs_native = (f"{fig['triton emulated'] / fig['triton native']:>30.2f}x"
                     if isinstance(fig["triton native"], float) else f"{'n/a':>31}")
        print(f"{name:>20} {cells} | {fig['triton emulated'] / fig['torch native']:>29.0f}x | {vs_native}")
        for c in cols:
            if not isinstance(fig[c], float):
                print(f"{'':>20} {c}: {fig[c]}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"command": sys.argv, "rounds": ns.rounds, "ms_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
