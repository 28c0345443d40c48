"""torch.compile on emulated GPUs vs the native CPU, eager and compiled (inductor), in one run.

    python bench/compile_speed.py [--steps N] [--rounds R] [--json out.json]

Times training steps (forward, backward, SGD step) of two small models — an
MLP and a pre-norm attention block (SDPA) — four ways:

- ``emulated eager``: ``cuda`` tensors inside ``mirage run --in-process``;
- ``emulated compiled``: the same with ``torch.compile(model)`` (inductor
  compiles graphs over the host tensors behind the emulated GPUs,
  shim/compile/torch_compile.py, docs/device.md);
- ``native eager`` and ``native compiled``: CPU tensors in a plain Python
  process (no shim), the latter with inductor's CPU code generation.

Each of the two workers builds the models from one seed, compiles them (the
first compiled step, timed: the compile time), warms up, then takes the best of
R windows of N steps, one thread each, the eager and compiled windows
alternating. Both compile from an empty inductor cache. The driver prints ms
per step, the compile times, and the ratios the issue sets goals for: compiled
emulated vs compiled native (goal ≤ 1.10), compiled vs eager emulated (goal ≤
1.0: compiling costs nothing extra on emulated GPUs), compile time emulated vs
native (goal ≤ 1.5).
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
MODELS = ("mlp", "attention block")


def build(name: str, device: str):
    """One of :data:`MODELS` on ``device`` and a batch for it."""
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        return model.to(device), torch.randn(32, 256, device=device)

    class Block(torch.nn.Module):
        def __init__(self, dim: int = 128, heads: int = 4):
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                           torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.mlp(self.norm2(x))

    return Block().to(device), torch.randn(4, 64, 128, device=device)


def stepper(model, x):
    """One training step of ``model`` on ``x`` (forward, backward, SGD), as a function."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def best_windows(steps_by_name: dict, steps: int, rounds: int) -> dict:
    """Best of ``rounds`` windows of ``steps`` steps for each entry, in ms per step; windows alternate
    between the entries (the machine's other load hits them alike) after a warm-up (the compiles)."""
    for step in steps_by_name.values():
        for _ in range(3):
            step()
    best = dict.fromkeys(steps_by_name, float("inf"))
    for _ in range(rounds):
        for name, step in steps_by_name.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / steps * 1e3)
    return best


def worker(kind: str, steps: int, rounds: int, out: str) -> None:
    """Time every model eager and compiled on ``cuda`` (kind ``emulated``) or the CPU (``native``)."""
    import torch

    torch.set_num_threads(1)
    device = "cuda" if kind == "emulated" else "cpu"
    if kind == "emulated" and "shim.activate" not in sys.modules:
        raise SystemExit("compile_speed --worker emulated must run inside mirage run")
    rows = {}
    for name in MODELS:
        runs = {f"{name}|{kind} eager": stepper(*build(name, device))}
        model, x = build(name, device)
        compiled = stepper(torch.compile(model), x)
        try:
            start = time.perf_counter()
            compiled()  # compiles (inductor's C++ code, which needs a compiler)
            rows[f"{name}|{kind} compile s"] = time.perf_counter() - start
            runs[f"{name}|{kind} compiled"] = compiled
        except Exception as e:  # noqa: BLE001 - reported in the table instead of a figure
            rows[f"{name}|{kind} compiled"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
        rows.update(best_windows(runs, steps, rounds))
    with open(out, "w") as f:
        json.dump(rows, f)


def main() -> None:
    """The driver: both workers, then the table and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per timed window")
    ap.add_argument("--rounds", type=int, default=5, help="windows per figure (the best is kept)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--worker", choices=("emulated", "native"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker(ns.worker, ns.steps, ns.rounds, ns.out)
        return
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # both compile from nothing
        me = [sys.executable, str(Path(__file__).resolve()), "--steps", str(ns.steps), "--rounds", str(ns.rounds)]
        runs = {
            "emulated": [sys.executable, "-m", "mirage_tui", "run", "--in-process", "--log-dir",
                         os.path.join(tmp, "runs"), "--", *me, "--worker", "emulated"],
            "native": [*me, "--worker", "native"],
        }
        for kind, cmd in runs.items():
            out = os.path.join(tmp, f"{kind}.json")
            r = subprocess.run([*cmd, "--out", out], cwd=ROOT, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"compile_speed: the {kind} worker failed:\n{(r.stdout + r.stderr)[-2000:]}")
            with open(out) as f:
                rows.update(json.load(f))
    print(f"{'model':>16} {'emulated eager':>15} {'emulated compiled':>18} {'native eager':>13} "
          f"{'native compiled':>16} | {'compile: emulated':>17} {'native':>7} | compiled emulated/native  "
          f"emulated compiled/eager  compile time emulated/native")
    for name in MODELS:
        fig = {k.split("|")[1]: v for k, v in rows.items() if k.startswith(name + "|")}
        for kind in ("emulated", "native"):
            if not isinstance(fig[f"{kind} compiled"], float):
                print(f"{name:>16} {kind} compiled: {fig[kind + ' compiled']}")
                break
        else:
            print(f"{name:>16} {fig['emulated eager']:>12.2f} ms {fig['emulated compiled']:>15.2f} ms "
                  f"{fig['native eager']:>10.2f} ms {fig['native compiled']:>13.2f} ms | "
                  f"{fig['emulated compile s']:>15.1f} s {fig['native compile s']:>5.1f} s | "
                  f"{fig['emulated compiled'] / fig['native compiled']:>24.2f}x "
                  f"{fig['emulated compiled'] / fig['emulated eager']:>22.2f}x "
                  f"{fig['emulated compile s'] / fig['native compile s']:>29.2f}x")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"command": sys.argv, "steps": ns.steps, "rounds": ns.rounds, "ms_per_step": rows}, f, indent=1)


if __name__ == "__main__":
    main()
