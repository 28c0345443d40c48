"""torch.profiler sees mirage's collectives as it sees ProcessGroupNCCL's (issue 15, item 5).

Real daemon, real ranks (mirage the launcher): the fixture profiles a block of
collectives and checks each one's async ``nccl:<op>`` event (input shapes
included) and its ``record_param_comms`` metadata in the exported chrome trace.
"""

from __future__ import annotations

import pytest

from test_run import FIXTURES, mirage_run

pytestmark = [pytest.mark.usefixtures("no_orphans"), pytest.mark.e2e]


def test_profiler_trace_shows_every_collective(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "profiler_comms.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] profiler_comms_ok" in r.stdout.splitlines()
    assert "[1] [rank 1] 9 collectives in the trace" in r.stdout.splitlines()
    # a CPU build's profiler warned at every op when asked for CUDA activity
    assert "Failed to record CUDA event" not in r.stdout + r.stderr
