"""Bad input to ``mirage run``: one line naming the problem (and the fix), exit 2 — or 127 for a program
that cannot be run — and nothing started, nothing written.

Extends tests/test_cli_usage.py (which has --gpus-per-node 0/65, --num-nodes 0, an unknown --profile, a
missing command, --env FOO, a non-integer --num-nodes, arguments without --, bad --inject specs). Each
case here runs the real CLI in an empty folder with ``--log-dir`` inside it, and checks afterwards that
the folder holds only what the test put there: no run directory, no journal, no daemon.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from wire.profiles import PROFILE_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]
MI350X = (PROFILE_DIR / "mi350x.toml").read_text()


def mirage(cwd: Path, *args: str, prog: str = "mirage", **env: str) -> subprocess.CompletedProcess[str]:
    path = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    code = "import sys; from mirage_tui.cli import main, tui_main; sys.exit((main if sys.argv[1] == 'mirage' else tui_main)(sys.argv[2:]))"
    return subprocess.run(
        [sys.executable, "-c", code, prog, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path), **env},
    )


def profiles(folder: Path) -> dict[str, Path]:
    """Profile files that are wrong in one way each."""
    files = {
        "malformed.toml": 'name = "x"\nproduct = [',
        "missing.toml": "\n".join(line for line in MI350X.splitlines() if not line.startswith("gfx ")),
        "wrongtype.toml": MI350X.replace("compute_units = 256", 'compute_units = "256"'),
        "unknownfield.toml": MI350X + "\nflux_capacitors = 3\n",
        "binary.toml": "\udcff\udcfe",
    }
    out = {}
    for name, text in files.items():
        out[name] = folder / name
        out[name].write_bytes(text.encode("utf-8", "surrogateescape"))
    (folder / "dir.toml").mkdir()
    return out


# (args before --, expected exit, text the one line must hold); "{d}" is the test's folder
CASES = [
    (["--num-nodes", "-3"], 2, "--num-nodes must be between 1 and 1024, got -3"),
    (["--num-nodes", "1025"], 2, "--num-nodes must be between 1 and 1024, got 1025"),
    (["--gpus-per-node", "1.5"], 2, "argument --gpus-per-node: invalid int value: '1.5'"),
    (["--gpus-per-node", "-1"], 2, "--gpus-per-node must be between 1 and 64, got -1"),
    (["--env", "=x"], 2, "--env expects KEY=VALUE, got '=x'"),
    (["--env", "A B=x"], 2, "--env name 'A B' is not a valid environment variable name"),
    (["--hang-timeout", "-1"], 2, "--hang-timeout must be a number of seconds above 0 (at most 86400), got -1"),
    (["--hang-timeout", "0"], 2, "--hang-timeout must be a number of seconds above 0"),
    (["--hang-timeout", "nan"], 2, "--hang-timeout must be a number of seconds above 0 (at most 86400), got nan"),
    (["--hang-timeout", "inf"], 2, "--hang-timeout must be a number of seconds above 0 (at most 86400), got inf"),
    (["--hang-timeout", "soon"], 2, "argument --hang-timeout: invalid float value: 'soon'"),
    (["--on-hang", "sometimes"], 2, "argument --on-hang: invalid choice: 'sometimes' (choose from 'exit', 'wait')"),
    (["--profile", ""], 2, "unknown profile ''; choose one of: mi300x"),
    (["--profile", "{d}/malformed.toml"], 2, "{d}/malformed.toml: "),
    (["--profile", "{d}/missing.toml"], 2, "{d}/missing.toml: missing field 'gfx'"),
    (["--profile", "{d}/wrongtype.toml"], 2, "{d}/wrongtype.toml: field 'compute_units' must be int, got str"),
    (["--profile", "{d}/unknownfield.toml"], 2, "{d}/unknownfield.toml: unknown field 'flux_capacitors'"),
    (["--profile", "{d}/binary.toml"], 2, "{d}/binary.toml: "),
    (["--profile", "{d}/dir.toml"], 2, "Is a directory"),
    (["--profile", "{d}/absent.toml"], 2, "No such file or directory"),
    (["--log-dir", "{d}/missing.toml"], 2, "--log-dir {d}/missing.toml: cannot create a run directory there (File exists)"),
    (["--log-dir", "{d}/missing.toml/runs"], 2, "cannot create a run directory there (Not a directory); pick a writable folder"),
    (["--log-dir", "{d}/" + "d" * 120], 2, "too long for the daemon's sockets (a socket's path must stay under 108 "
                                           "bytes); pick a folder whose path has at most 70 bytes"),
    (["--in-process", "--num-nodes", "2"], 2, "--in-process runs without the daemon, so it cannot join --num-nodes 2"),
    (["--in-process", "--on-hang", "wait"], 2, "--on-hang wait acts on the daemon's hang reports, and --in-process has no"),
    (["--program-clock", "emulated"], 2, "--program-clock emulated reads the emulated clock, which --exec-mode "
                                         "functional does not keep; add --exec-mode clocked or drop --program-clock"),
    (["--report", "{d}/no/such/folder/r.json"], 2, "--report {d}/no/such/folder/r.json: cannot write a file there"),
    (["--report", "{d}"], 2, "--report {d}: cannot write a file there; pick a file in a writable folder"),
    (["--inject", "rank=-1,seq=1,action=hang"], 2, "rank"),
]
HBM_CASES = [
    (["--hbm", "3parsecs"], 2, "--hbm expects a size such as 8GiB, 512MiB or 80GB, got '3parsecs'"),
    (["--hbm", "0"], 2, "--hbm must be above zero, got '0'"),
    (["--hbm=-8GiB"], 2, "--hbm expects a size"),
]


def _has_flag(flag: str) -> bool:
    return flag in subprocess.run([sys.executable, "-m", "mirage_tui", "run", "--help"], cwd=REPO_ROOT,
                                  capture_output=True, text=True).stdout


def check_refused(d: Path, r: subprocess.CompletedProcess[str], code: int, text: str, prog: str = "mirage") -> None:
    assert r.returncode == code, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{prog}: error: ")
    assert text.format(d=d) in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    # nothing started, nothing written: only the test's own files are there
    assert sorted(p.name for p in d.iterdir()) == sorted(["binary.toml", "dir.toml", "malformed.toml", "missing.toml",
                                                          "unknownfield.toml", "wrongtype.toml"])


@pytest.fixture
def short_dir():
    """An empty folder with a short path: a run folder inside pytest's long tmp_path would be refused as too long
    for the daemon's sockets before the problem a case is about."""
    d = Path(tempfile.mkdtemp(prefix="mrb-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("args, code, text", CASES + HBM_CASES, ids=[" ".join(c[0]) for c in CASES + HBM_CASES])
def test_bad_flag(short_dir, args, code, text):
    if args[0].startswith("--hbm") and not _has_flag("--hbm"):
        pytest.skip("--hbm is not a flag of this checkout")
    d = short_dir
    profiles(d)
    args = [a.format(d=d) for a in args]
    r = mirage(d, "run", "--log-dir", str(d / "runs"), *args, "--", "python", "-c", "pass")
    check_refused(d, r, code, text)


def test_batch_console_refuses_the_same(tmp_path):
    profiles(tmp_path)
    r = mirage(tmp_path, "--batch", "--log-dir", str(tmp_path / "runs"), "--hang-timeout", "-1", "--", "python",
               prog="mirage-tui")
    check_refused(tmp_path, r, 2, "--hang-timeout must be a number of seconds above 0", prog="mirage-tui")


# ---------------------------------------------------------------- the program itself


@pytest.fixture
def programs(tmp_path):
    profiles(tmp_path)
    bin_dir = tmp_path / "dir.toml"  # a folder already there; holds a script without execute permission
    script = bin_dir / "train.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    return tmp_path, script


@pytest.mark.parametrize(
    "command, env, text",
    [
        (["no-such-program-xyz"], {}, "command not found: no-such-program-xyz (searched PATH="),
        (["{d}/absent.sh"], {}, "command not found: {d}/absent.sh (tried {d}/absent.sh: no such file)"),
        (["./absent.sh"], {}, "command not found: ./absent.sh (tried {d}/absent.sh: no such file)"),
        (["{d}/dir.toml/train.sh"], {}, "command not executable: {d}/dir.toml/train.sh (tried {d}/dir.toml/train.sh: "
                                        "it has no execute permission)"),
        (["{d}/dir.toml"], {}, "command not executable: {d}/dir.toml (tried {d}/dir.toml: it is a directory)"),
        (["train.sh"], {"PATH": "{d}/dir.toml"}, "command not executable: train.sh (found {d}/dir.toml/train.sh, "
                                                "which has no execute permission)"),
        # the nodes' PATH is what --env says it is
        (["python"], {"PATH": "/nonexistent"}, "command not found: python (searched PATH=/nonexistent)"),
    ],
    ids=["bare name", "absolute path", "relative path", "not executable", "directory", "on PATH, no x",
         "--env PATH"],
)
def test_program_that_cannot_run_exits_127_before_anything_starts(programs, command, env, text):
    d, _ = programs
    command = [c.format(d=d) for c in command]
    env_flags = [f for k, v in env.items() for f in ("--env", f"{k}={v.format(d=d)}")]
    r = mirage(d, "run", "--log-dir", str(d / "runs"), *env_flags, "--", *command, "--flag-of-its-own")
    assert r.returncode == 127, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mirage: error: "), r.stderr
    assert text.format(d=d) in lines[0], lines[0]
    assert not (d / "runs").exists()  # no run directory, no daemon: nothing was started
