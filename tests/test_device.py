"""The emulated GPUs as a program sees them (issue 3): one real rank process per test, no mocks.

The checks themselves live in ``tests/fixtures/ml/device_surface.py`` so the
same program can be run by hand under ``mirage run``.
"""

from __future__ import annotations

import json

import pytest

from tests.test_run import FIXTURES, events, mirage_run, run_dir

pytestmark = pytest.mark.usefixtures("no_orphans")


def test_device_surface_memory_rng_streams_autocast_sdpa(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "2", "--hbm", "256MiB", "--",
                   "python", str(FIXTURES / "device_surface.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] device_surface_ok" in r.stdout.splitlines()


def test_reset_parameters_on_sharded_dtensors_draws_per_shard_and_per_seed(tmp_path):
    """FSDP2 and TP meta-init + to_empty("cuda") + reset_parameters(): DTensor's RNG tracker on the GPU generators."""
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "dtensor_init.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] dtensor_init_ok" in r.stdout.splitlines()
    assert "[1] [rank 1] tp: reset_parameters on 4 DTensors ok" in r.stdout.splitlines()


def test_out_of_memory_is_torchs_error_with_the_allocators_message(tmp_path):
    program = ("import torch\n"
               "x = torch.empty(48 << 20, dtype=torch.uint8, device='cuda')\n"
               "y = torch.empty(32 << 20, dtype=torch.uint8, device='cuda')\n")
    r = mirage_run(tmp_path, "--in-process", "--hbm", "64MiB", "--", "python", "-c", program)
    assert r.returncode == 1
    assert ("[0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a total "
            "capacity of 64.00 MiB of which 16.00 MiB is free.") in r.stderr, r.stderr[-2000:]


def test_memory_history_and_snapshots_read_as_pytorchs(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "2", "--hbm", "64MiB", "--", "python",
                   str(FIXTURES / "memory_snapshot.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] memory_snapshot_ok" in r.stdout.splitlines()


def test_data_parallel_and_single_process_collectives_match_the_cpu(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "3", "--", "python",
                   str(FIXTURES / "data_parallel.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] data_parallel_ok" in r.stdout.splitlines()


def test_sync_debug_mode_flags_what_waits_for_the_gpu(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--", "python", str(FIXTURES / "sync_debug.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] sync_debug_ok" in r.stdout.splitlines()


def test_cuda_graphs_capture_and_replay_as_on_a_gpu(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--", "python", str(FIXTURES / "cuda_graphs.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] cuda_graphs_ok" in r.stdout.splitlines()


def test_tunableop_settings_answer_as_on_rocm_and_nothing_is_tuned(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--env", "PYTORCH_TUNABLEOP_ENABLED=1", "--env",
                   "PYTORCH_TUNABLEOP_MAX_TUNING_ITERATIONS=7", "--", "python", str(FIXTURES / "tunableop.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] tunableop_ok" in r.stdout.splitlines()
    assert r.stderr.count("mirage: TunableOp is on, and tunes nothing on the emulated GPUs") == 1, r.stderr


def test_a_collective_inside_a_cuda_graph_capture_is_refused_naming_it(tmp_path):
    program = ("import tempfile, torch, torch.distributed as dist\n"
               "dist.init_process_group('nccl', init_method=f'file://{tempfile.mkdtemp()}/s', rank=0, world_size=1)\n"
               "x = torch.ones(4, device='cuda')\n"
               "dist.all_reduce(x)\n"
               "with torch.cuda.graph(torch.cuda.CUDAGraph()):\n"
               "    dist.all_reduce(x)\n")
    r = mirage_run(tmp_path, "--", "python", "-c", program)
    assert r.returncode == 1
    assert ("RuntimeError: mirage: a collective during CUDA graph capture is not emulated (it would not be "
            "replayed); capture the compute only, and run collectives outside the graph") in r.stderr, r.stderr[-3000:]


def test_ranks_report_gpu_memory_to_the_daemon(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hbm", "1GiB", "--", "torchrun", "--standalone",
                   "--nproc_per_node=2", str(FIXTURES / "ddp_mlp.py"), steps=100)  # several report intervals
    assert r.returncode == 0, r.stderr[-3000:]
    usage = [e for e in events(tmp_path) if e["type"] == "memory_usage"]
    assert {(e["rank"], e["device"]) for e in usage} == {(0, 0), (1, 1)}
    # --hbm reaches every rank through torchrun
    assert all(0 <= e["allocated"] <= e["peak"] and 0 < e["peak"] and e["total"] == 1 << 30 for e in usage), usage
    # each rank reported memory in use at some point (a last report, after the model is freed, may say 0)
    assert {e["rank"] for e in usage if e["allocated"] > 0} == {0, 1}, usage
    report = json.loads((run_dir(tmp_path) / "report.json").read_text())
    assert set(report["gpu_memory"]) == {"0", "1"}


_BACKWARD_HERE = """
import threading, torch
from shim.cuda import engine
print("guard:", engine.GUARD_ERROR)
w = torch.ones(4, 4, device="cuda", requires_grad=True)
threads = []
w.register_hook(lambda g: threads.append(threading.current_thread() is threading.main_thread()) or g * 3)
(w * 2).sum().backward()
print("grad", w.grad.device, w.grad.sum().item(), "hooks on the calling thread:", threads)
with torch.cuda.device(1):
    s = torch.cuda.Stream()
    e = torch.cuda.Event(enable_timing=True)
    e.record(s)
    print("stream", s.device, e.query(), torch.cuda.current_device())
"""


@pytest.mark.parametrize("compiler", ["c++", "none"])
def test_backward_runs_on_the_calling_thread_with_either_device_guard(tmp_path, compiler):
    """shim/cuda/engine.py: the graph runs where backward() was called; the C++ device guard, or torch's
    Python one where it cannot be built, answer the same."""
    env = [] if compiler == "c++" else ["--env", f"MIRAGE_CACHE_DIR={tmp_path / 'cache'}",
                                        "--env", "CXX=/nonexistent/c++"]
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "2", *env, "--", "python", "-c", _BACKWARD_HERE)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    guard = "None" if compiler == "c++" else ("no C++ compiler: '/nonexistent/c++' not found "
                                              "(CXX names the compiler, default c++)")
    assert f"[0] guard: {guard}" in lines, lines
    assert "[0] grad cuda:0 96.0 hooks on the calling thread: [True]" in lines, lines
    assert "[0] stream cuda:1 True 1" in lines, lines


# ---------------------------------------------------------------- the allocator model, in process

def test_allocator_counts_storages_once_and_caches_segments():
    import torch

    from shim.memory.allocator import Allocator
    from shim.memory.blocks import SMALL_BUFFER as SEGMENT

    alloc = Allocator(capacity=64 << 20, count=2)
    t = torch.empty(1000, dtype=torch.float32)  # 4000 B -> 4096 B in 512 B blocks
    k1 = alloc.hold(t, 0)
    k2 = alloc.hold(t[10:], 0)  # a view of the same storage
    d = alloc.devices[0]
    assert k1 == k2 and d.allocated == 4096 and d.allocation.total == 1
    assert d.reserved_total == SEGMENT and alloc.devices[1].allocated == 0
    alloc.release(k1)
    alloc.sync()
    assert d.allocated == 4096  # the view still holds it
    alloc.release(k2)
    alloc.sync()
    assert d.allocated == 0 and d.reserved_total == SEGMENT  # freed, but the segment stays cached
    alloc.empty_cache()
    assert d.reserved_total == 0
    stats = d.nested()
    assert stats["allocated_bytes"]["all"] == {"current": 0, "peak": 4096, "allocated": 4096, "freed": 4096}
    alloc.reset_peak(0)
    assert d.nested()["allocated_bytes"]["all"]["peak"] == 0


def test_allocator_refuses_what_does_not_fit_with_torchs_message():
    import torch

    from shim.memory.allocator import Allocator, format_size

    alloc = Allocator(capacity=40 << 20, count=1)
    keep = torch.empty(12 << 20, dtype=torch.uint8)  # a 12 MiB segment of its own
    alloc.hold(keep, 0)
    alloc.check(0, 5 << 20)
    alloc.hold(torch.empty(5 << 20, dtype=torch.uint8), 0)  # a 20 MiB segment, split: 15 MiB stay cached
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 16\.00 MiB\. "
                       r"GPU 0 has a total capacity of 40\.00 MiB of which 8\.00 MiB is free\. .* Of the allocated "
                       r"memory 17\.00 MiB is allocated by PyTorch, and 15\.00 MiB is reserved by PyTorch but "
                       r"unallocated\."):
        alloc.check(0, 16 << 20)  # no cached block holds it, and a 16 MiB segment does not fit
    assert alloc.devices[0].num_ooms == 1
    # a request between 1 and 10 MiB allocates a 20 MiB segment, and the message names the segment
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 20\.00 MiB\. "
                       r"GPU 0 has a total capacity of 10\.00 MiB of which 10\.00 MiB is free\."):
        Allocator(capacity=10 << 20, count=1).check(0, 5 << 20)
    assert (format_size(1024), format_size(1536), format_size(3 << 30)) == ("1024 bytes", "1.50 KiB", "3.00 GiB")


def test_the_allocators_settings_are_read_as_a_rocm_build_reads_them(tmp_path):
    program = ("import torch\n"
               "x = torch.empty(100 << 20, dtype=torch.uint8, device='cuda')\n"
               "print('max_split', torch.cuda.memory_stats()['max_split_size'])\n")
    r = mirage_run(tmp_path, "--in-process", "--env",
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:64,"
                   "garbage_collection_threshold:0.8", "--", "python", "-c", program)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[0] max_split {64 << 20}" in r.stdout.splitlines(), r.stdout
    assert "UserWarning: expandable_segments not supported on this platform" in r.stderr, r.stderr
    assert r.stderr.count("mirage: PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold not modeled") == 1
    r = mirage_run(tmp_path, "--in-process", "--env", "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:8", "--",
                   "python", "-c", program)
    assert r.returncode == 1
    assert ("RuntimeError: PYTORCH_CUDA_ALLOC_CONF: CachingAllocator option max_split_size_mb too small, "
            "must be > 20") in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("text, size", [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("80GB", 80 * 10**9),
                                        ("1.5G", 3 << 29), ("4096", 4096)])
def test_hbm_sizes(text, size):
    from mirage_tui.config.topology import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["3parsecs", "0", "-1GiB", "GiB", ""])
def test_bad_hbm_sizes_are_usage_errors(text):
    from mirage_tui.config.topology import UsageError, parse_size

    with pytest.raises(UsageError, match="--hbm"):
        parse_size(text)
