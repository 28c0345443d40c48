"""Estimate mode's peak GPU memory against torch's own estimator, for the same FSDP2 Llama, in one run.

    python bench/estimate_memory.py [--size small|8b] [--gpus N]

Runs ``tests/fixtures/frameworks/llama_fsdp2.py`` (a transformers Llama from its config, FSDP2 over each
layer and the model, bf16 compute, AdamW, two steps) under ``mirage run --exec-mode estimate`` on N
emulated MI300X, and the same model, sharding and steps under torch's ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``: fake tensors, a fake process group of N ranks, no
mirage), then prints both peaks and their ratio. ``--size 8b`` is Llama-3-8B at a sequence of 8192
(a few minutes); ``small`` is 2 layers of hidden 256 (seconds).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "fixtures" / "frameworks" / "llama_fsdp2.py"
SIZES = {
    "small": {"LAYERS": 2, "HIDDEN": 256, "INTERMEDIATE": 512, "HEADS": 4, "KV_HEADS": 2, "VOCAB": 32000, "SEQ": 256},
    "8b": {},  # the fixture's defaults: Llama-3-8B, sequence 8192
}


def tracker_peak(world: int) -> int:
    """Torch's FSDPMemTracker's peak ("Total") for the fixture's model and steps, in bytes (sizes from the env)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    def env(name: str, default: int) -> int:
        return int(os.environ.get(name, default))

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    config = LlamaConfig(vocab_size=env("VOCAB", 128256), hidden_size=env("HIDDEN", 4096),
                         intermediate_size=env("INTERMEDIATE", 14336), num_hidden_layers=env("LAYERS", 32),
                         num_attention_heads=env("HEADS", 32), num_key_value_heads=env("KV_HEADS", 8),
                         max_position_embeddings=8192, rope_theta=500000.0, attn_implementation="sdpa")
    with FakeTensorMode():
        model = LlamaForCausalLM(config)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, config.vocab_size, (1, env("SEQ", 8192)))
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((tokens,))
        with tracker:
            for step in range(2):
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()  # it tracks one iteration at a time; the peak stays
    (stats,) = tracker.get_tracker_snapshot("peak").values()
    return int(stats["Total"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--tracker", action="store_true", help=argparse.SUPPRESS)  # the subprocess's side
    a = p.parse_args()
    if a.tracker:
        print(f"TRACKER {tracker_peak(a.gpus)}")
        return
    env = dict(os.environ, **{k: str(v) for k, v in SIZES[a.size].items()}, HF_HUB_OFFLINE="1")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    torch_run = subprocess.run([sys.executable, __file__, "--tracker", "--gpus", str(a.gpus)], env=env, cwd=ROOT,
                               capture_output=True, text=True, check=True)
    tracked = int(re.search(r"^TRACKER (\d+)$", torch_run.stdout, re.M).group(1))
    envs = [x for k, v in SIZES[a.size].items() for x in ("--env", f"{k}={v}")]
    mirage = subprocess.run(
        [sys.executable, "-m", "mirage_tui", "run", "--gpus-per-node", str(a.gpus), "--profile", "mi300x",
         "--exec-mode", "estimate", *envs, "--", "torchrun", "--nproc-per-node", str(a.gpus), str(SCRIPT)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    peak = int(re.search(r"peak allocated (\d+)", mirage.stdout).group(1))
    (predicted,) = [line for line in mirage.stderr.splitlines() if "predicted step" in line]
    print(f"{'size':>6} {'GPUs':>5} | {'torch FSDPMemTracker':>22} {'mirage estimate':>18} | estimate/tracker")
    print(f"{a.size:>6} {a.gpus:>5} | {tracked:>16} bytes {peak:>12} bytes | {peak / tracked:.4f}x")
    print(f"  ({tracked / 2**30:.2f} GiB vs {peak / 2**30:.2f} GiB; {predicted.removeprefix('mirage: ')})")


if __name__ == "__main__":
    main()
