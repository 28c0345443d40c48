"""Fixtures for the multihost tests: a Slurm cluster whose hosts are network namespaces.

Every test here is marked ``multihost``; run them alone with
``bash tests/run_suite.sh -m multihost``. They need root, ``ip netns``, and Debian's
``slurm-wlm`` and ``munge``: missing packages are apt-get installed (as root) unless
``SKIP_INSTALL=1``; otherwise the tests skip, saying why. See cluster.py and docs/scaling.md.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster, ensure_installed, reap_stale, unavailable_reason  # noqa: E402

_reason: list = []  # the skip reason, computed once per process


def multihost_unavailable() -> str | None:
    """Why these tests cannot run here (installing what is missing first), or None."""
    if not _reason:
        reason = None
        if hasattr(os, "geteuid") and os.geteuid() == 0 and os.environ.get("SKIP_INSTALL") != "1":
            reason = ensure_installed()
        _reason.append(reason or unavailable_reason())
    return _reason[0]


@pytest.fixture(scope="session")
def multihost_ready():
    """Skips the test when a cluster cannot be built; reaps clusters a killed run left behind."""
    reason = multihost_unavailable()
    if reason:
        pytest.skip(reason)
    reap_stale()


@pytest.fixture(scope="session")
def cluster(multihost_ready):
    """A 2-host cluster (h1, h2) shared by the tests of one pytest process (one per xdist worker).

    Tests that break a cluster (kill a host, tear it down) build their own with ``Cluster(...)``.
    """
    with Cluster(2) as c:
        yield c
