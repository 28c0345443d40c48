"""Issue 15, item 1: ``Module.to("cuda")`` and ``.data =`` keep a tensor's identity, as on a GPU build.

Before this, ``Module.to`` made new Parameter objects, so an optimizer built
before the move (Accelerate's recipe) stepped the stale host tensors and the
run exited 0 having trained nothing; ``.data =`` across devices raised, and
``.data =`` between two emulated tensors left the old data in place.
"""

from __future__ import annotations

import pytest

from tests.test_run import FIXTURES, mirage_run

pytestmark = pytest.mark.usefixtures("no_orphans")


def test_module_to_and_data_assignment_keep_the_tensor(tmp_path):
    r = mirage_run(tmp_path, "--in-process", "--gpus-per-node", "2", "--", "python",
                   str(FIXTURES / "param_identity.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] param_identity_ok" in r.stdout.splitlines()
