"""``--exec-mode estimate`` (issue 30, section 2): the clock and the GPU memory without the values.

Real ``mirage run`` sessions of DDP (``fixtures/ml/estimate_ddp.py``), no mocks: at a
size both modes run, estimate mode reports the same memory figures and the same predicted step
as clocked mode; at a size the host could never hold it runs in seconds; past the profile's HBM
it raises torch's own out-of-memory error; a value read on the host is zeros with one notice per
call site; a shape that depends on values is refused in one line.
"""

from __future__ import annotations

import re

import pytest

from tests.test_run import FIXTURES, mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")

PROGRAM = str(FIXTURES / "estimate_ddp.py")


def _run(tmp_path, mode: str, *env: str, timeout: float = 240):
    envs = [a for kv in env for a in ("--env", kv)]
    return mirage_run(tmp_path, "--gpus-per-node", "2", "--exec-mode", mode, *envs, "--nproc-per-node", "2", "--",
                      "python", PROGRAM, timeout=timeout)


def _memory(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[0] memory ")]


def _predicted(stderr: str) -> str:
    """The prediction, without the mode it names (``mirage: clocked (mi350x): ...``, ``mirage: estimate ...``)."""
    (line,) = [line for line in stderr.splitlines() if "predicted step" in line]
    return line.split("): ", 1)[1]


def test_estimate_gives_clocked_modes_memory_and_step_time(tmp_path):
    clocked = _run(tmp_path / "clocked", "clocked")
    estimate = _run(tmp_path / "estimate", "estimate")
    for r in (clocked, estimate):
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "[0] estimate_ddp_ok" in r.stdout and "[1] estimate_ddp_ok" in r.stdout
    assert _memory(estimate.stdout) == _memory(clocked.stdout) and len(_memory(clocked.stdout)) == 3
    assert _predicted(estimate.stderr) == _predicted(clocked.stderr)
    assert "mirage: estimate (mi350x): predicted step" in estimate.stderr
    # the first loss comes from tensors that keep their values (all of them up to 1 MiB); after the
    # first all-reduce of the gradients' bucket (4 MiB, no values) the losses are unknown: zeros, said once
    losses = [line for line in estimate.stdout.splitlines() if line.startswith("[0] step ")]
    want = [line for line in clocked.stdout.splitlines() if line.startswith("[0] step ")]
    assert losses[0] == want[0] and losses[1:] == ["[0] step 1 loss 0.0000", "[0] step 2 loss 0.0000"], losses
    notices = [line for line in estimate.stderr.splitlines() if "reads a value" in line]
    assert len(notices) == 2, notices  # one per rank, the loss's .item() site
    assert notices[0].endswith("estimate_ddp.py:40:<module> reads a value, which --exec-mode estimate does not "
                               "keep: it reads zeros (this notice is printed once per call site)"), notices


def test_estimate_times_tensor_parallel_collectives_as_clocked_mode(tmp_path):
    """DTensor's functional collectives (torch's Meta kernels of them move and post nothing) are posted,
    matched and timed as in clocked mode."""
    runs = [mirage_run(tmp_path / mode, "--gpus-per-node", "2", "--exec-mode", mode, "--nproc-per-node", "2", "--",
                       "python", str(FIXTURES / "estimate_tp.py")) for mode in ("clocked", "estimate")]
    for r in runs:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "[0] estimate_tp_ok" in r.stdout
    clocked, estimate = runs
    assert _memory(estimate.stdout) == _memory(clocked.stdout) and _memory(clocked.stdout)
    assert _predicted(estimate.stderr) == _predicted(clocked.stderr)
    assert "communication 0 s" not in _predicted(estimate.stderr)


def test_estimate_runs_a_model_the_host_could_not_hold(tmp_path):
    """Two ranks of 16 GiB of parameters each, with AdamW: 96 GiB a GPU at its peak, on a 24 GiB box."""
    r = _run(tmp_path, "estimate", "WIDTH=32768")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (last,) = _memory(r.stdout)[-1:]
    allocated, peak = (int(n) for n in re.findall(r"(?:allocated|peak) (\d+)", last)[:2])
    params = 4 * (32768 * 32768 + 32768) * 4
    assert allocated >= 4 * params  # parameters, gradients and AdamW's two moments
    assert peak > 96 << 30, last
    assert "predicted step" in r.stderr


def test_estimate_past_the_gpus_memory_raises_torchs_error(tmp_path):
    r = _run(tmp_path, "estimate", "WIDTH=65536")
    assert r.returncode != 0
    assert ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total capacity "
            "of 288.00 GiB") in r.stderr, r.stderr[-3000:]


def test_a_shape_that_depends_on_values_is_refused_in_one_line(tmp_path):
    r = _run(tmp_path, "estimate", "REFUSE=1")
    assert r.returncode != 0
    assert ("RuntimeError: mirage: aten.nonzero at " + PROGRAM + ":44:<module> needs the values of its input to "
            "shape its output, and --exec-mode estimate keeps none") in r.stderr, r.stderr[-3000:]


def test_estimate_needs_the_daemon(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--exec-mode", "estimate", "--", "python", "-c", "pass")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("mirage: error: --exec-mode estimate needs the daemon, which keeps "
                                                 "the emulated clock across ranks, and --in-process has none; drop "
                                                 "one of the two; see 'mirage run --help'")
