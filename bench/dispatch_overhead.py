"""The shim's cost on every op: a CPU-bound training step natively vs on emulated cuda, same machine, one run.

    python bench/dispatch_overhead.py

Runs bench/dispatch_worker.py three ways: plain CPU torch (no mirage), CPU
tensors inside a mirage rank (the global TorchFunctionMode's cost alone), and
emulated cuda tensors (mode + __torch_dispatch__ wrapper). Prints ms per step
and the ratio to native. Issue 3's target: emulated cuda <= 1.3x native.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench/dispatch_worker.py")


def rows(cmd: list[str]) -> dict[str, float]:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])))
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    out = {}
    for line in r.stdout.splitlines():
        line = line.removeprefix("[0] ")
        if line.startswith("{"):
            row = json.loads(line)
            out[row["model"]] = row["ms"]
    return out


def main() -> None:
    native = rows([sys.executable, WORKER, "cpu"])
    with tempfile.TemporaryDirectory() as tmp:
        mirage = [sys.executable, "-m", "mirage_tui", "run", "--log-dir", tmp, "--", "python", WORKER]
        moded = rows(mirage + ["cpu"])
        emulated = rows(mirage + ["cuda"])
    print(f"{'model':>18} {'native cpu':>11} {'cpu in rank':>12} {'emulated cuda':>14} {'cuda/native':>12}")
    for model, ms in native.items():
        print(f"{model:>18} {ms:9.2f}ms {moded[model]:10.2f}ms {emulated[model]:12.2f}ms {emulated[model] / ms:11.2f}x")


if __name__ == "__main__":
    main()
