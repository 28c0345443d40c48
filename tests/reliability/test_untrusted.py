"""Untrusted clients of a live session: who can reach the daemon, what a wrong token gets, what listens.

A real ``mirage run`` whose rank (plain Python, no torch) probes its own
session from the inside: the run directory's modes, another user's attempt to
connect, pings without, with a wrong and with the right token, and the
session's network listeners.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from test_run import mirage_run, run_dir

WORKLOADS = Path(__file__).resolve().parent / "workloads"
pytestmark = pytest.mark.usefixtures("no_orphans")


def probes(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[0] probe "):
            key, _, value = line.removeprefix("[0] probe ").partition("=")
            out[key] = value
    return out


@pytest.fixture
def traversable(tmp_path):
    """Let other users traverse (not list) the folders above the run directory, so only its own 0700 stops them."""
    # every folder of ours on the way up (pytest's basetemp may be nested under a private folder)
    chain = [p for p in [tmp_path, *tmp_path.parents] if p != p.parent and p.stat().st_uid == os.getuid()]
    # every mode bit, the sticky one included: as root the chain reaches /tmp, which must stay 1777
    modes = [stat.S_IMODE(p.stat().st_mode) for p in chain]
    for p, m in zip(chain, modes):
        p.chmod(m | 0o111)
    try:
        yield tmp_path
    finally:
        for p, m in zip(chain, modes):
            p.chmod(m)


def test_session_refuses_strangers_and_logs_it(traversable):
    tmp_path = traversable
    r = mirage_run(tmp_path, "--", "python", str(WORKLOADS / "probe_sockets.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    p = probes(r.stdout)
    # private run directory: the ipc sockets live in it, so only this user reaches them
    assert p["run_dir_mode"] == "0o700" and p["ranks_mode"] == "0o700" and p["token_mode"] == "0o600"
    assert p["rpc_in_run_dir"] == "True"
    if os.getuid() == 0:
        assert p["other_user_connect"] == "EACCES"
    # without a token or with a wrong one: refused, with a reason; with the right one: answered
    for name in ("none", "wrong"):
        reply = json.loads(p[f"ping_{name}"])
        assert reply["type"] == "error" and reply["code"] == "protocol", reply
        assert "unauthorized: wrong or missing session token" in reply["message"]
    assert json.loads(p["ping_right"])["type"] == "ok"
    assert p["inet_listeners"] == "0"
    # the refusals are logged in the run's journal
    d = run_dir(tmp_path)
    with open(d / "events.jsonl") as f:
        refused = [e for line in f if (e := json.loads(line))["type"] == "protocol_error"]
    assert [e["message"] for e in refused] == ["unauthorized: wrong or missing session token"] * 2
    # and in the daemon's log
    log = (d / "daemon.log").read_text()
    assert log.count("mirage daemon: refused request #") == 2
    assert "refused request #2 from client " in log and log.rstrip().count("unauthorized: wrong or missing") == 2
    # the token does not outlive the run
    assert not (d / "token").exists()
    assert oct(d.stat().st_mode & 0o777) == "0o700"
