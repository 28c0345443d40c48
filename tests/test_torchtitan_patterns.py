"""Three things torchtitan's Llama 3 8B recipe met under ``--exec-mode estimate`` (and clocked mode), each with a
program of one GPU (``fixtures/ml/torchtitan_patterns.py``): the memory of activation checkpointing's recomputation
never freed, an empty step after each step of an optimizer that steps another, and a bogus block counted on every
rank but 0 for FSDP2's all-gather input."""

from __future__ import annotations

import json

import pytest

from tests.test_run import FIXTURES, mirage_run, run_dir

pytestmark = pytest.mark.usefixtures("no_orphans")

PROGRAM = str(FIXTURES / "torchtitan_patterns.py")


def _run(tmp_path, mode: str, case: str):
    r = mirage_run(tmp_path, "--exec-mode", mode, "--env", f"CASE={case}", "--", "python", PROGRAM)
    assert r.returncode == 0 and "[0] torchtitan_patterns_ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.parametrize("mode", ["functional", "estimate"])
def test_activation_checkpointing_frees_what_it_recomputes(tmp_path, mode):
    r = _run(tmp_path, mode, "checkpoint")
    memory = [line for line in r.stdout.splitlines() if line.startswith("[0] memory ")]
    assert len(memory) == 3 and len(set(memory)) == 1, memory


def test_an_optimizer_stepping_another_ends_one_step(tmp_path):
    _run(tmp_path, "clocked", "container")
    steps = [e for e in map(json.loads, (run_dir(tmp_path) / "events.jsonl").read_text().splitlines())
             if e.get("type") == "clocked_step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4], steps
    assert all(e["ops"] > 0 for e in steps), steps


def test_views_at_an_offset_without_values_are_counted_as_their_storage(tmp_path):
    clocked = _run(tmp_path / "clocked", "clocked", "offset_views")
    estimate = _run(tmp_path / "estimate", "estimate", "offset_views")
    lines = [line for line in estimate.stdout.splitlines() if line.startswith("[0] memory rank")]
    assert lines == [line for line in clocked.stdout.splitlines() if line.startswith("[0] memory rank")]
    assert all(line.endswith(" then 0") for line in lines), lines
