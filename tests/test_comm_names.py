"""Communicators as torch names them, and what each carried, on a real run of 4 emulated GPUs.

The fixture (``fixtures/ml/named_groups.py``) makes the default group, a
``new_group(group_desc="experts")`` and a 2x2 DeviceMesh ("dp", "tp"), with
rank 2 slow before each of the default group's all-reduces: the names reach
``events.jsonl``, ``report.json``, the report's text, ``mirage status`` and the
Flight Recorder dumps, and the report counts each communicator's collectives and
bytes exactly and names rank 2 the default group's slowest.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
from test_flight_recorder import analyze
from test_run import FIXTURES, REPO_ROOT, events, mirage_run, run_dir

from mirage_tui.reports import flight_recorder, report
from mirage_tui.state.runstate import Outcome, RunState

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture(scope="module")
def named_run(tmp_path_factory):
    """One run of the fixture, shared by this file's tests (4 ranks take a while to start on two cores)."""
    tmp = tmp_path_factory.mktemp("named")
    r = mirage_run(tmp, "--gpus-per-node", "4", "--nproc-per-node", "4", "--", "python",
                   str(FIXTURES / "named_groups.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


def test_torchs_names_reach_the_journal_and_report_json(named_run):
    joined = [e for e in events(named_run) if e["type"] == "comm_joined"]
    descs = {e["comm"]: e["desc"] for e in joined}
    assert sorted(descs.values()) == ["default_pg", "experts", "mesh_dp", "mesh_dp", "mesh_tp", "mesh_tp"]
    assert {e["name"] for e in joined if e["desc"] == "default_pg"} == {"0"}
    doc = json.loads((run_dir(named_run) / "report.json").read_text())
    comms = doc["communicators"]
    by_label = {c["label"]: (comm, c) for comm, c in comms.items()}
    # a name two communicators share keeps their ids' first characters; a unique one stands alone
    assert {label.split(" (")[0] for label in by_label} == {"default_pg", "experts", "mesh_dp", "mesh_tp"}
    for comm, c in comms.items():
        unique = c["desc"] in ("default_pg", "experts")
        assert c["label"] == (c["desc"] if unique else f"{c['desc']} ({comm[:8]})")
    # exact counts and bytes (a collective's bytes: one rank's buffer); rank 2 the default group's slowest
    default = by_label["default_pg"][1]
    assert (default["size"], default["collectives"], default["bytes"]) == (4, 5, 5 * 16 * 4)
    assert default["slowest_rank"] == 2 and default["last_arrivals"]["2"] >= 3, default
    # the three fast ranks wait about 0.3 s for rank 2 before each of the 5 (some of it before the first)
    assert default["wait_s"] > 3 * 0.3 * 4 * 0.8, default
    experts = by_label["experts"][1]
    assert (experts["size"], experts["collectives"], experts["bytes"]) == (2, 3, 3 * 1024 * 4)
    assert set(experts["ranks"]) == {"1", "3"}
    for label, (_, c) in by_label.items():
        if label.startswith("mesh_"):
            assert (c["size"], c["collectives"], c["bytes"]) == (2, 1, 16)
    # peak GPU memory per rank: the experts' 4 KiB on ranks 1 and 3 (reported at exit, if not before)
    peaks = {r: v["peak_gpu_memory"] for r, v in doc["ranks"].items()}
    assert peaks["1"] >= 4096 and peaks["3"] >= 4096 and all(p > 0 for p in peaks.values()), peaks


def test_the_report_status_and_flight_recorder_name_them(named_run):
    path = run_dir(named_run)
    state = RunState.from_journal(str(path / "events.jsonl"))
    text = report.render(state, Outcome(0, "ok", str(path)), str(path))
    lines = [" ".join(line.split()) for line in text.splitlines()]
    (default,) = [line for line in lines if line.startswith("default_pg (")]
    assert "4 ranks 5 collectives 320 B waited" in default and "slowest rank 2 (last at" in default
    assert any(line.startswith("experts (") and "2 ranks 3 collectives 12.0 KiB" in line for line in lines)
    assert all(line.startswith("rank ") and " peak " in line for line in lines if line.startswith("rank "))

    r = subprocess.run([sys.executable, "-m", "mirage_tui", "status", str(path)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    heads = [line for line in r.stdout.splitlines() if line.startswith("communicator ")]
    assert len(heads) == 6 and heads[0].startswith("communicator default_pg (")
    assert sum(h.startswith("communicator mesh_tp (") for h in heads) == 2
    assert any(h.startswith("communicator experts (") for h in heads)

    fr = flight_recorder.dump_run(str(path))
    with open(f"{fr}/{flight_recorder.PREFIX}1", "rb") as f:
        dump = pickle.load(f)
    assert sorted(g["desc"] for g in dump["pg_config"].values()) == ["default_pg", "experts", "mesh_dp", "mesh_tp"]
    assert dump["pg_config"]["0"]["desc"] == "default_pg"
    out = analyze(fr)
    assert "Not all ranks joining collective" not in out and "mismatch" not in out.lower(), out
