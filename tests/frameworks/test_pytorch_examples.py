"""pytorch/examples' distributed programs, unmodified (tests/fixtures/frameworks/examples/), by their README commands.

Each runs in a copy of its folder under tmp_path (they write snapshots and checkpoints beside
themselves) and must exit 0 with the lines that show every rank trained on its GPU.
"""

from __future__ import annotations

import shutil

import pytest

from tests.frameworks.fwrun import FW, free_port, mirage_in

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

EXAMPLES = FW / "examples"


def _copy(tmp_path, name):
    work = tmp_path / name
    shutil.copytree(EXAMPLES / name, work)
    return work, tmp_path / "r"  # short: the daemon's socket paths live under it


def _ok(r):
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "mirage: ok" in r.stderr, r.stderr[-2000:]


def test_ddp_tutorial_series_multigpu_torchrun(tmp_path):
    work, runs = _copy(tmp_path, "ddp-tutorial-series")
    r = mirage_in(work, runs, 2, "torchrun", "--standalone", "--nproc_per_node=2", "multigpu_torchrun.py", "3", "1")
    _ok(r)
    for rank in (0, 1):
        assert f"[{rank}] [GPU{rank}] Epoch 2 | Batchsize: 32 | Steps: 32" in r.stdout.splitlines(), r.stdout[-3000:]
    assert "[0] Epoch 2 | Training snapshot saved at snapshot.pt" in r.stdout.splitlines()
    # a second run resumes from the snapshot, as on a GPU machine
    r = mirage_in(work, runs, 2, "torchrun", "--standalone", "--nproc_per_node=2", "multigpu_torchrun.py", "4", "1")
    _ok(r)
    assert "[0] Resuming training from snapshot at Epoch" in r.stdout, r.stdout[-3000:]
    assert "[1] [GPU1] Epoch 3 | Batchsize: 32 | Steps: 32" in r.stdout.splitlines()


def test_ddp_tutorial_series_nproc_per_node_gpu(tmp_path):
    """The tutorial's own command: torchrun counts the GPUs (`--nproc_per_node=gpu`)."""
    work, runs = _copy(tmp_path, "ddp-tutorial-series")
    r = mirage_in(work, runs, 2, "torchrun", "--standalone", "--nproc_per_node=gpu", "multigpu_torchrun.py", "1", "1")
    _ok(r)
    assert "[1] [GPU1] Epoch 0 | Batchsize: 32 | Steps: 32" in r.stdout.splitlines(), r.stdout[-3000:]


def test_tensor_parallelism_examples(tmp_path):
    """tensor_parallel_example.py and sequence_parallel_example.py, one after the other: the
    README's rendezvous endpoint is a fixed port."""
    work, runs = _copy(tmp_path, "tensor_parallelism")
    for i, (script, what) in enumerate((("tensor_parallel_example.py", "Tensor Parallel"),
                                        ("sequence_parallel_example.py", "Sequence Parallel"))):
        r = mirage_in(work, runs / str(i), 2, "torchrun", "--nnodes=1", "--nproc_per_node=2", "--rdzv_id=101",
                      "--rdzv_endpoint=localhost:5972", script)
        _ok(r)
        log = next((runs / str(i)).iterdir()) / "rank-0.log"
        assert f"{what} iter 9 completed" in log.read_text(), log.read_text()[-3000:]


def test_mingpt_ddp_tiny_with_amp(tmp_path):
    """minGPT-ddp with a tiny model and use_amp=True (fp16 autocast + GradScaler), snapshots every epoch
    (``dataclasses.asdict`` of the state dict: a ``copy.deepcopy`` of cuda tensors)."""
    work, runs = _copy(tmp_path, "minGPT-ddp")
    (work / "input.txt").write_text("".join(f"{i} little pigs went to market, and {i + 1} stayed home.\n"
                                            for i in range(30)))
    tiny = ["data_config.path=input.txt", "data_config.truncate=1.0", "data_config.block_size=32",
            "gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=64",
            "trainer_config.max_epochs=2", "trainer_config.batch_size=16", "trainer_config.data_loader_workers=0",
            "trainer_config.save_every=1", "trainer_config.use_amp=True"]
    r = mirage_in(work, runs, 2, "torchrun", "--standalone", "--nproc_per_node=2", "main.py", *tiny)
    _ok(r)
    assert "Snapshot saved at epoch 1" in r.stdout, r.stdout[-3000:]


def test_fsdp2_example(tmp_path):
    """FSDP2/example.py: train, then save and reload a full-state-dict checkpoint (its default, non-DCP path)."""
    work, runs = _copy(tmp_path, "FSDP2")
    # the README's command with the port made free: left alone, torchrun takes 29500
    r = mirage_in(work, runs, 2, "torchrun", "--nproc_per_node", "2", f"--master_port={free_port()}", "example.py")
    _ok(r)
    assert (work / "checkpoints").is_dir()
