"""Running a framework workload under mirage and on CPU + gloo, and comparing what they print.

Every workload in tests/fixtures/frameworks/ ends with ``fwcheck.finish``, whose ``RESULT {...}``
line (rank 0) carries the device, the first and final loss and a parameter checksum; the
workload itself already failed unless the loss fell and every rank held the same parameters.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.test_run import REPO_ROOT

FW = REPO_ROOT / "tests" / "fixtures" / "frameworks"
_RESULT = re.compile(r"^(?:\[\d+\] )?RESULT (\{.*\})$", re.M)


def framework_env() -> dict[str, str]:
    """The environment for a framework run: the venv's tools first, nothing downloaded."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def deepspeed_cpu_extensions() -> dict[str, str]:
    """``TORCH_EXTENSIONS_DIR`` for DeepSpeed's CPU accelerator, its shared-memory op built there.

    DeepSpeed's CPU backend JIT-builds ``deepspeed_shm_comm`` under torch's FileBaton, a plain
    ``lock`` file that a process killed while holding it leaves behind: every later run then
    waits on it forever. The build lives in this checkout's venv, made once under a kernel lock
    (released when its holder dies), and a baton older than a minute found while holding that
    lock is stale (a current build holds it for well under a second) and removed.
    """
    root = Path(sys.prefix) / "torch_extensions"
    root.mkdir(exist_ok=True)
    env = framework_env() | {"TORCH_EXTENSIONS_DIR": str(root)}
    with open(root / ".mirage-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        baton = root / "deepspeed_shm_comm" / "lock"
        if baton.exists() and time.time() - baton.stat().st_mtime > 60:
            baton.unlink()
        subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                       env=env, check=True, capture_output=True, timeout=600)
    return {"TORCH_EXTENSIONS_DIR": str(root)}


def free_port() -> int:
    """A TCP port free now, for launchers whose default port is fixed (torchrun without --standalone, deepspeed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result(out: str) -> dict:
    """The one RESULT line a workload's rank 0 printed, parsed."""
    found = _RESULT.findall(out)
    assert len(found) == 1, f"expected one RESULT line, got {len(found)}:\n{out[-4000:]}"
    return json.loads(found[0])


def under_mirage(tmp_path: Path, *command: str, steps: int, gpus: int = 2, timeout: float = 280) -> dict:
    """Run COMMAND under ``mirage run --gpus-per-node GPUS``; it must exit 0 on cuda. Returns its RESULT."""
    r = mirage_in(REPO_ROOT, tmp_path, gpus, *command, steps=steps, timeout=timeout)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    res = result(r.stdout)
    assert res["device"].startswith("cuda"), res
    assert res["world"] == gpus, res
    return res


def mirage_in(cwd: Path, log_dir: Path, gpus: int, *command: str, steps: int | None = None,
              timeout: float = 280, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``mirage run --log-dir LOG_DIR --gpus-per-node GPUS -- COMMAND`` started in CWD, $STEPS set when given."""
    env = framework_env()
    if steps is not None:
        env["STEPS"] = str(steps)
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "mirage_tui", "run", "--log-dir", str(log_dir), "--gpus-per-node", str(gpus), "--",
         *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def on_cpu(*command: str, steps: int | None = None, extra_env: dict[str, str] | None = None,
           timeout: float = 280) -> dict:
    """Run COMMAND plainly (no mirage: CPU tensors, gloo); it must exit 0. Returns its RESULT.

    Tried three times: this is the reference, not what is under test, and plain torch on the CPU
    sometimes aborts at exit after a finished run ("terminate called without an active exception",
    three times in a row in one CI run). A run that printed its RESULT and then aborted so has
    computed the reference all the same, and is taken.
    """
    env = framework_env()
    if steps is not None:
        env["STEPS"] = str(steps)
    env.update(extra_env or {})
    outs = []
    for _ in range(3):
        r = subprocess.run(list(command), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        finished = _RESULT.search(r.stdout) and "terminate called without an active exception" in r.stderr
        if r.returncode == 0 or finished:
            res = result(r.stdout)
            assert res["device"].startswith("cpu"), res
            return res
        outs.append(r.stdout[-3000:] + r.stderr[-3000:])
    raise AssertionError("the CPU + gloo reference failed three times:\n" + "\n----\n".join(outs))


def assert_same_training(gpu: dict, cpu: dict, rel: float = 1e-4) -> None:
    """The emulated-GPU run computed what the CPU + gloo run did: losses and weights within REL."""
    for key in ("first", "final", "checksum"):
        a, b = gpu[key], cpu[key]
        assert abs(a - b) <= rel * max(abs(a), abs(b), 1e-12), f"{key}: mirage {a} vs CPU+gloo {b}\n{gpu}\n{cpu}"
