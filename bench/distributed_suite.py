"""PyTorch's own ``DistributedTest`` under mirage: a pass / fail / skip table, with torch's skip reasons.

Runs ``tests/fixtures/ml/torch_distributed_spawn.py`` (the wheel's
``torch/testing/_internal/distributed/distributed_test.py``, driven as
pytorch's ``test/distributed/test_distributed_spawn.py`` drives it:
``BACKEND=nccl``, ranks are multiprocessing spawn children of pytest) in one
``mirage run --gpus-per-node N`` and reads pytest's JUnit XML.

    python bench/distributed_suite.py                       # every *_cuda and DDP test, 2 GPUs
    python bench/distributed_suite.py --gpus 4 -k "_cuda"   # a pytest -k expression of your own
    python bench/distributed_suite.py --markdown            # the table as docs/compatibility.md has it
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests/fixtures/ml/torch_distributed_spawn.py"
#: every test whose name says CUDA, and every DDP test
DEFAULT_K = "_cuda or DistributedDataParallel or test_ddp_"


def run(gpus: int, k: str | None, timeout_s: float, extra: list[str],
        names: list[str] | None = None) -> tuple[list[tuple[str, str, str, float]], float, int]:
    """One mirage run of the tests ``k`` selects (or exactly those ``names``): (test, outcome, reason,
    seconds) rows, seconds taken in all, mirage's exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        temp_dir = Path(tmp) / "temp"
        (temp_dir / "barrier").mkdir(parents=True)
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        # as --env: mirage gives a single node's command no WORLD_SIZE of its own (as a GPU machine has none)
        test_env = [f"--env={k}={v}" for k, v in (("BACKEND", "nccl"), ("WORLD_SIZE", gpus), ("TEMP_DIR", temp_dir))]
        start = time.monotonic()
        r = subprocess.run(
            # a hung test is torch's harness's to time out and report: mirage's report must not stop the rest
            [sys.executable, "-m", "mirage_tui", "run", "--gpus-per-node", str(gpus), "--on-hang", "wait", *test_env, "--",
             sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             *([f"{FIXTURE}::TestDistBackendWithSpawn::{n}" for n in names] if names else [str(FIXTURE), "-k", k]),
             f"--junitxml={xml}", *extra],
            cwd=ROOT, env=env, check=False, timeout=timeout_s,
        )
        took = time.monotonic() - start
        if not xml.exists():
            raise SystemExit(f"distributed_suite: pytest wrote no report (mirage exited {r.returncode})")
        rows = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, reason = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                    reason = _one_line(el.get("message") or el.text or "")
                    break
            rows.append((case.get("name", "?"), outcome, reason, float(case.get("time", 0))))
    return rows, took, r.returncode


def _one_line(text: str) -> str:
    """The line of a failure or skip message that says why (the last non-empty one of a traceback)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):  # a rank's exception is reported as "<Type>: <message>" near the end
        if "Error" in ln or "Exception" in ln or "assert" in ln.lower():
            return ln[:200]
    return (lines[0] if lines else "")[:200]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2, help="emulated GPUs and WORLD_SIZE (default 2)")
    p.add_argument("-k", default=DEFAULT_K, help=f"pytest -k expression (default: {DEFAULT_K!r})")
    p.add_argument("--timeout", type=float, default=7200, help="seconds for the whole run")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    a = p.parse_args()
    rows, took, rc = run(a.gpus, a.k, a.timeout, a.pytest_args)
    counts = Counter(row[1] for row in rows)
    ran = counts["passed"] + counts["failed"]
    if a.markdown:
        print("| test | result | reason |\n|---|---|---|")
        for name, outcome, reason, _ in sorted(rows, key=lambda r: (r[1] != "failed", r[1], r[0])):
            print(f"| `{name}` | {outcome} | {reason.replace('|', '/')} |")
    else:
        width = max((len(row[0]) for row in rows), default=10)
        for name, outcome, reason, took_s in sorted(rows, key=lambda r: (r[1] != "failed", r[1], r[0])):
            print(f"{name:<{width}}  {outcome:<7} {took_s:5.1f} s  {reason}")
    print(f"\n{len(rows)} tests with {a.gpus} GPUs in {took:.0f} s: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped by torch; pass rate {counts['passed'] / ran:.0%} of those run"
          if ran else f"\n{len(rows)} tests: none ran")
    sys.exit(1 if counts["failed"] or rc not in (0, 1) else 0)


if __name__ == "__main__":
    main()
