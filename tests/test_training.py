"""The training stacks people run, end to end under ``mirage run``, compared with CPU + gloo.

Each test runs a fixture from ``tests/fixtures/ml/`` through the real CLI,
daemon and rank processes, and — where the program can also run on CPU
tensors with gloo — runs it again plainly (no mirage) with ``--device cpu``
and checks both print the same losses and weight checksums. The
``no_orphans`` fixture fails a test that leaves a process of its session behind.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from test_run import FIXTURES, REPO_ROOT, SOCKET_ENV, mirage_run

# every test here starts rank processes and trains (the registered meaning of "slow")
pytestmark = [pytest.mark.usefixtures("no_orphans"), pytest.mark.slow, pytest.mark.e2e]

#: "[rank 0] step 3 loss 0.41995", "[rank 0] checksum 12.89819", "[rank 1] checksum find_unused 4.29",
#: "[rank 1] step 0 loss gpipe 0.41995" (a figure of one of several parts a program runs)
_FIGURE = re.compile(r"\[rank (\d+)\] (step \d+ loss(?: \w+)?|checksum(?: \w+)?) (-?\d+\.\d+)")


def figures(text: str) -> dict[tuple[str, str], float]:
    """Every rank's printed losses and checksums, keyed by (rank, what)."""
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in _FIGURE.finditer(text)}


def run_on_cpu(*args: str, nprocs: int, steps: int, env: dict | None = None) -> str:
    """The fixture run plainly on CPU + gloo (no mirage in sight), as ``torchrun --standalone`` would run it;
    its stdout. Its ranks are forked from one interpreter that imported torch (``tests/fork_ranks.py``): the
    same program and environment, without an interpreter and an import of torch per rank (seconds of CPU each)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_")}
    clean.update(env or {}, STEPS=str(steps))
    clean["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), clean.get("PATH", "")])
    for _ in range(3):  # plain CPU torch with gloo sometimes aborts at exit ("terminate called without an
        # active exception"): the reference, not what is under test, so it is tried again
        r = subprocess.run(
            [sys.executable, str(REPO_ROOT / "tests" / "fork_ranks.py"), str(nprocs), *args, "--device", "cpu"],
            cwd=REPO_ROOT, env=clean, capture_output=True, text=True, timeout=240,
        )
        if r.returncode == 0 or "terminate called without an active exception" not in r.stderr:
            break
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def assert_same_figures(emulated: str, reference: str, rel: float) -> None:
    got, want = figures(emulated), figures(reference)
    assert want, f"the CPU run printed no figures:\n{reference}"
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-5), (key, got[key], value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_variants_under_mp_spawn_match_gloo(tmp_path):
    """mp.spawn + hard-coded MASTER_PORT, DistributedSampler/DataLoader workers (batches pinned), fp16 and
    PowerSGD comm hooks, no_sync, find_unused_parameters and static_graph, snapshot resume with map_location;
    SyncBatchNorm and AMP checked inside the fixture."""
    steps = 4
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--env", f"DDP_VARIANTS_PORT={free_port()}",
                   "--env", f"DDP_VARIANTS_DIR={tmp_path}", "--", "python", str(FIXTURES / "ddp_variants.py"),
                   steps=steps)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] ddp_variants_ok" in r.stdout
    # spawned children's lines are their own rank's once they form the world
    assert "[1] [rank 1] syncbn ok" in r.stdout
    assert "[1] [rank 1] amp ok" in r.stdout
    # the same program on CPU + gloo, its workers forked: spawned (as above), each of them and each of their
    # DataLoader workers would import torch afresh, most of this test's CPU; the checksums are the same
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_")}
    env.update(STEPS=str(steps), DDP_VARIANTS_PORT=str(free_port()), DDP_VARIANTS_DIR=str(tmp_path))
    cpu = subprocess.run([sys.executable, str(FIXTURES / "ddp_variants.py"), "--device", "cpu", "--nprocs", "2",
                          "--start-method", "fork"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    # torch's own gloo can abort a spawned child as the interpreter finalizes, after the program has finished
    # ("terminate called without an active exception", pytorch/pytorch#179291): the figures are all printed by then
    assert cpu.returncode == 0 or "ddp_variants_ok" in cpu.stdout, cpu.stdout + cpu.stderr
    # fp16 compression sums two fp16 values per element, exactly; the float32 sums of two of the others, too
    assert_same_figures(r.stdout, cpu.stdout, rel=1e-6)
    assert {what for _, what in figures(r.stdout)} == {"checksum fp16_hook_no_sync", "checksum powersgd",
                                                       "checksum find_unused", "checksum static_graph"}


def test_ddp_unused_parameters_refused_without_a_compiler(tmp_path):
    """Where the pinned host allocator cannot be built, pinning falls back to copies and DDP refuses
    find_unused_parameters / static_graph at construction, saying why (instead of aborting in backward)."""
    r = mirage_run(tmp_path, "--gpus-per-node", "1", "--env", f"MIRAGE_CACHE_DIR={tmp_path / 'cache'}",
                   "--env", "CXX=/nonexistent/c++", "--", "python", str(FIXTURES / "pinned_fallback.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] pinned_fallback_ok" in r.stdout
    for arg in ("find_unused_parameters", "static_graph"):
        assert (f"[0] refused {arg}: mirage: DistributedDataParallel({arg}=True) needs mirage's pinned host "
                "allocator, which this machine lacks: no C++ compiler: '/nonexistent/c++' not found") in r.stdout


def test_backend_extras_on_four_gpus(tmp_path):
    """async Work/futures, premul_sum, monitored_barrier's refusal, new_subgroups, split_group,
    2-D DeviceMesh groups, destroy and re-init."""
    r = mirage_run(tmp_path, "--gpus-per-node", "4", "--nproc-per-node", "4", "--", "python",
                   str(FIXTURES / "backend_extras.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] backend_extras_ok" in r.stdout


def test_async_collectives_soak(tmp_path):
    """Random batches of async collectives over two communicators, waited on in a different order per rank."""
    r = mirage_run(tmp_path, "--gpus-per-node", "4", "--nproc-per-node", "4", "--", "python",
                   str(FIXTURES / "async_soak.py"), steps=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] async_soak_ok" in r.stdout


def test_fsdp2_matches_gloo(tmp_path):
    """meta init + to_empty, per-layer fully_shard with bf16 params / fp32 reduce, explicit prefetch,
    clip_grad_norm_ on DTensors, broadcast_from_rank0, DCP save/load round trip. (On 4 GPUs it also
    matches gloo, in 23 s: by hand, see docs/compatibility.md.)"""
    gpus, steps = 2, 4
    r = mirage_run(tmp_path, "--gpus-per-node", str(gpus), "--env", f"FSDP2_DIR={tmp_path}", "--nproc-per-node",
                   str(gpus), "--", "python", str(FIXTURES / "fsdp2_train.py"), steps=steps)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] fsdp2_ok" in r.stdout
    cpu = run_on_cpu(str(FIXTURES / "fsdp2_train.py"), nprocs=gpus, steps=steps, env={"FSDP2_DIR": str(tmp_path)})
    assert_same_figures(r.stdout, cpu, rel=1e-4)


def test_pipeline_parallel_schedules_match_gloo(tmp_path):
    """torch.distributed.pipelining: a PipelineStage per rank, 4 microbatches, activations and gradients
    crossing ranks as send/recv; GPipe then 1F1B, each on a stage of its own, in one launch (one world
    under mirage, one under CPU + gloo) whose lines name the schedule."""
    gpus, steps, schedules = 2, 3, ("gpipe", "1f1b")
    r = mirage_run(tmp_path, "--gpus-per-node", str(gpus), "--nproc-per-node", str(gpus), "--", "python",
                   str(FIXTURES / "pipeline_train.py"), "--schedule", ",".join(schedules),
                   steps=steps)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] pipeline_ok" in r.stdout
    cpu = run_on_cpu(str(FIXTURES / "pipeline_train.py"), "--schedule", ",".join(schedules), nprocs=gpus,
                     steps=steps)
    assert_same_figures(r.stdout, cpu, rel=1e-5)
    # every schedule's losses (the last stage's) and each stage's checksum, from both runs
    want = {("1", f"step {step} loss {name}") for name in schedules for step in range(steps)}
    want |= {(str(rank), f"checksum {name}") for name in schedules for rank in range(gpus)}
    assert set(figures(r.stdout)) == want, sorted(figures(r.stdout))


def test_tensor_and_sequence_parallel_with_fsdp2_match_gloo(tmp_path):
    """init_device_mesh on a 2-D (dp, tp) mesh, parallelize_module (Sequence/Colwise/Rowwise/
    PrepareModuleInput) on tp, fully_shard on dp, AdamW foreach. (``--dp 1`` runs TP alone on a 1-D mesh.)"""
    gpus, dp, steps = 4, 2, 3
    r = mirage_run(tmp_path, "--gpus-per-node", str(gpus), "--nproc-per-node", str(gpus), "--", "python",
                   str(FIXTURES / "tp_train.py"), "--dp", str(dp), steps=steps)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] tp_ok" in r.stdout
    cpu = run_on_cpu(str(FIXTURES / "tp_train.py"), "--dp", str(dp), nprocs=gpus, steps=steps)
    assert_same_figures(r.stdout, cpu, rel=1e-4)


@pytest.mark.parametrize("nodes, gpus", [(1, 8), (2, 4)])
def test_ddp_at_eight_gpus(tmp_path, nodes, gpus):
    """The DDP fixture on 8 emulated GPUs: one node, and two nodes of four over the socket transport."""
    fixture = str(FIXTURES / "ddp_mlp.py")
    if nodes == 1:
        args = ["--gpus-per-node", "8", "--nproc-per-node", "8", "--", "python", fixture]
    else:  # one torchrun per emulated node, as on a cluster
        launch = ("exec torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$MIRAGE_NODE_RANK "
                  f"--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT {fixture}")
        args = ["--num-nodes", "2", "--gpus-per-node", "4", *SOCKET_ENV, "--", "bash", "-c", launch]
    r = mirage_run(tmp_path, *args, steps=10, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] [rank 0] all ranks converged with identical replicas" in r.stdout
    assert "[7] [rank 7] training on cuda:" in r.stdout


def test_ddp_reports_its_times_as_on_a_gpu(tmp_path):
    """DDP's reducer times forward, backward and communication on emulated GPUs (a timer registered for
    the backend's device type, ``shim/native/comms_native.cpp``), and prints no warning that it cannot."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "ddp_timers.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] ddp_timers_ok" in r.stdout.splitlines()
    assert "Time stats are currently only collected" not in r.stdout + r.stderr


def test_ddp_join_over_uneven_inputs_matches_gloo(tmp_path):
    """DDP's ``join()`` with rank 0 out of batches first (PyTorch's DistributedTest ``test_ddp_uneven_inputs``,
    ``test_ddp_grad_div_uneven_inputs``): gradients divided by the ranks still training (the reducer waits
    on Join's Work in backward, a Python Work only C++ holds) and the joined rank's map of used parameters
    all-reduced with ``pg.allreduce(tensor)`` (c10d's single-tensor overload); the weights end equal on
    both ranks and to CPU + gloo's."""
    steps = 5
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "ddp_join_uneven.py"), steps=steps)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] ddp_join_uneven_ok" in r.stdout.splitlines()
    cpu = run_on_cpu(str(FIXTURES / "ddp_join_uneven.py"), nprocs=2, steps=steps)
    assert_same_figures(r.stdout, cpu, rel=1e-6)
    assert {what for _, what in figures(r.stdout)} == {"checksum grad_div", "checksum unused"}


@pytest.mark.parametrize("mode", ["destroy", "exit"])
def test_collectives_in_flight_complete_before_a_rank_lets_go(tmp_path, mode):
    """A rank that leaves hundreds of collectives unwaited (as FSDP2's full-state-dict gathers do) and then
    destroys its group or exits first must not free what its peers' collectives still read: it completes
    them first, as ``ncclCommFinalize`` does, and the slower rank gets every result right."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", "120", "--env", f"MODE={mode}",
                   "--env", "MIRAGE_ZERO_COPY=always", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "inflight_at_exit.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] inflight_ok" in r.stdout.splitlines()
    assert "[1] [rank 1] leaving with 90 collectives never waited for" in r.stdout.splitlines()


def test_ddp_on_a_gpu_that_is_not_the_current_one(tmp_path):
    """DDP of a model on ``cuda:<rank>`` with no ``set_device`` (PyTorch's own DDP tests): the reducer's
    C++ allocations follow the module's GPU, not the current one (before: "Duplicate GPU detected")."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "ddp_no_set_device.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] ddp_no_set_device_ok" in r.stdout.splitlines()


def test_checkpoints_and_deep_copies_of_gpu_tensors_stay_on_their_gpu(tmp_path):
    """``torch.save`` of emulated GPUs' tensors saves what a GPU build saves (storages tagged ``cuda:<i>``,
    Parameters as Parameters): a pickled DDP model comes back with GPU Parameters and trains (before:
    CPU tensors without ``requires_grad``, and the reducer's ``!tensors.empty()`` assertion); and
    ``copy.deepcopy`` of a GPU model works (before: ``Storage device not recognized: cuda``)."""
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "2", "--", "python",
                   str(FIXTURES / "save_load_gpu.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] save_load_gpu_ok" in r.stdout.splitlines()
