"""Every rank's Python stacks at a hang, read back from the run's ``hang-report.json``.

The session writes the report (:func:`mirage_tui.reports.diagnosis.write`) before it
publishes the ``hang_report`` event, so the file is there when the console hears
of the hang; a replay reads the recorded run's copy. No Textual here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

REPORT = "hang-report.json"


@dataclass(frozen=True)
class RankStacks:
    """One rank's part in a hang: its role (``missing`` or ``joined``), where it was, its stacks."""

    rank: int
    role: str
    heading: str
    stacks: str


def load(run_dir: str, comm: str, seq: int, fallback: str = "") -> list[RankStacks]:
    """The ranks of the hang at collective ``seq`` of ``comm``, missing ranks first.

    ``run_dir``'s report is read first, then ``fallback`` (the path the event
    named: the same file for a live run, where it was recorded for a replay).
    Raises OSError or ValueError if neither holds that hang.
    """
    for path in dict.fromkeys(p for p in (run_dir and os.path.join(run_dir, REPORT), fallback) if p):
        try:
            with open(path, encoding="utf-8") as f:
                reports = json.load(f)
        except FileNotFoundError:
            continue
        # the latest report of that collective: a long run can hang on the same seq of two communicators
        for report in reversed(reports):
            if report.get("comm") == comm and report.get("seq") == seq:
                return _ranks(report)
    raise ValueError(f"no report of the hang at collective #{seq} of {comm[:8]} in {run_dir}/{REPORT}")


def current_thread_first(stacks: str) -> str:
    """faulthandler's dump with the thread it interrupted (normally the main thread: the user's code) first."""
    blocks = stacks.split("\n\n")
    current = [b for b in blocks if b.lstrip().startswith("Current thread")]
    return "\n\n".join(current + [b for b in blocks if b not in current])


def _ranks(report: dict) -> list[RankStacks]:
    missing = {m["rank"] for m in report.get("missing", [])}
    out = []
    for key, r in report.get("ranks", {}).items():
        rank = int(key)
        role = "missing" if rank in missing else "joined"
        heading = f"rank {rank} ({role}): pid {r.get('pid')}, {r.get('process')}"
        if r.get("last_output"):
            heading += f"; last output: {r['last_output']}"
        out.append(RankStacks(rank, role, heading, current_thread_first(r.get("stacks") or "(no stacks: the rank did not answer)")))
    # the ranks everybody waits for first: their stacks say why
    return sorted(out, key=lambda s: (s.role != "missing", s.rank))
