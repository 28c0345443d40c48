"""Flight Recorder dumps: torch's own analyzer (fr_trace) reads what we write and names the culprit."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from test_run import FIXTURES, REPO_ROOT, mirage_run, run_dir

from mirage_tui.reports.flight_recorder import PREFIX, dump_run, write_dumps
from wire import schema as s

SITE = "/job/train.py:42:train_step"


def analyze(trace_dir, *flags: str) -> str:
    """Run torch's Flight Recorder analyzer on ``trace_dir``; its findings go to stderr (a logger)."""
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(trace_dir), "-p", PREFIX, *flags],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


class Journal:
    """A synthetic event stream with a clock that ticks per event."""

    def __init__(self) -> None:
        self.events: list[s.Event] = []
        self.t = 1_700_000_000.0

    def add(self, cls, **kw) -> None:
        self.t += 0.001
        self.events.append(cls(t=self.t, **kw))

    def join(self, comm: str, global_ranks: list[int]) -> None:
        for rank, g in enumerate(global_ranks):
            self.add(s.RankRegistered, rank=g, pid=1000 + g)
            self.add(s.CommJoined, comm=comm, rank=rank, size=len(global_ranks), global_rank=g)

    def collective(self, comm: str, seq: int, ranks: list[int], op=s.CollOp.ALLREDUCE, numel=8,
                   dtype="float32", done=True, numels: dict[int, int] | None = None) -> None:
        """Comm ranks ``ranks`` post collective ``seq``; it starts and completes if ``done``."""
        for r in ranks:
            self.add(s.CollectiveEnqueued, comm=comm, seq=seq, rank=r, op=op, dtype=dtype,
                     numel=(numels or {}).get(r, numel), site=SITE)
        if done:
            self.add(s.CollectiveStarted, comm=comm, seq=seq, op=op, total_bytes=numel * 4)
            self.add(s.CollectiveCompleted, comm=comm, seq=seq, op=op, total_bytes=numel * 4, seconds=0.002)


def test_missing_rank_is_named_by_torchs_analyzer(tmp_path):
    j = Journal()
    j.join("c0", [0, 1])
    for seq in (1, 2, 3):
        j.collective("c0", seq, [0, 1])
    j.collective("c0", 4, [0], done=False)  # rank 1 never joins collective 4

    paths = write_dumps(j.events, str(tmp_path / "fr"))

    assert paths == [str(tmp_path / "fr" / f"{PREFIX}{r}") for r in (0, 1)]
    assert stat.S_IMODE(os.stat(tmp_path / "fr").st_mode) == 0o700
    out = analyze(tmp_path / "fr")
    assert "Not all ranks joining collective, sequence number: 4" in out
    assert "collective: nccl:all_reduce" in out
    assert "missing ranks: {1}" in out
    assert "expected ranks: {0, 1}" in out
    assert "group info: 0:default_pg" in out
    assert "collective state: scheduled" in out
    assert "train_step at /job/train.py:42" in out  # the call site, as a stack frame


def test_healthy_trace_of_every_op_and_two_groups_has_no_findings(tmp_path):
    j = Journal()
    j.join("world", [0, 1, 2])
    j.join("sub", [1, 2])  # a new_group of global ranks 1 and 2
    j.collective("world", 1, [0, 1, 2])
    j.collective("world", 2, [0, 1, 2], op=s.CollOp.BROADCAST, dtype="bfloat16")
    j.collective("sub", 1, [0, 1], op=s.CollOp.ALLGATHER, numel=4)
    j.collective("world", 3, [0, 1, 2], op=s.CollOp.REDUCE_SCATTER, numel=12, dtype="int64")
    j.collective("sub", 2, [0, 1], op=s.CollOp.BARRIER, numel=0)

    write_dumps(j.events, str(tmp_path))

    out = analyze(tmp_path)
    assert "sequence number" not in out and "error" not in out.lower(), out
    # verbose mode lists the matched collectives: all five, each matched on every member rank
    verbose = analyze(tmp_path, "-v")
    assert verbose.count("pass_check=True") == 5 and "pass_check=False" not in verbose, verbose
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_reduce_barrier"):
        assert f"collective_name='nccl:{op}'" in verbose


def test_size_mismatch_in_all_gather_is_reported(tmp_path):
    j = Journal()
    j.join("c0", [0, 1])
    j.collective("c0", 1, [0, 1])
    j.collective("c0", 2, [0, 1], op=s.CollOp.ALLGATHER, numels={0: 4, 1: 6}, done=False)

    write_dumps(j.events, str(tmp_path))

    out = analyze(tmp_path)
    assert "Collective sequence number: 2 has errors" in out
    assert "collective: nccl:all_gather" in out
    assert "SIZE_OR_SYNTAX_MISMATCH" in out


def test_dump_run_skips_torn_lines_and_loads_no_torch(tmp_path):
    j = Journal()
    j.join("c0", [0, 1])
    j.collective("c0", 1, [0, 1])
    j.collective("c0", 2, [1], done=False)
    with open(tmp_path / "events.jsonl", "wb") as f:
        for e in j.events:
            f.write(s.encode(e) + b"\n")
        f.write(b'{"v":1,"type":"coll_enq')  # a live writer's unfinished line

    out_dir = dump_run(str(tmp_path))

    assert out_dir == str(tmp_path / "flight-recorder")
    assert sorted(os.listdir(out_dir)) == [f"{PREFIX}0", f"{PREFIX}1"]
    assert "missing ranks: {0}" in analyze(out_dir)
    # the console imports this module; it must not drag torch in
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, mirage_tui.reports.flight_recorder; print('torch' in sys.modules)"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr


@pytest.mark.usefixtures("no_orphans")
def test_real_hang_dumps_name_the_skipped_all_reduce(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--hang-timeout", "2", "--",
                   "torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "skip_allreduce.py"),
                   timeout=120)
    assert r.returncode == 124, r.stderr

    out = analyze(dump_run(str(run_dir(tmp_path))))

    assert "Not all ranks joining collective, sequence number: 3" in out, out
    assert "collective: nccl:all_reduce" in out
    assert "missing ranks: {1}" in out
    assert "input sizes: [[8]]" in out
    assert "skip_allreduce.py:17" in out
