"""The real ``mirage`` command: usage errors are one line and exit 2; help works.

Each case runs ``python -m mirage_tui`` in a fresh empty directory, the way a
user would, so a usage error that started anything would leave a trace there.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mirage_tui.cli import tui_main
from mirage_tui.config.topology import Topology, UsageError, parse_env, validate

REPO_ROOT = Path(__file__).resolve().parent.parent


def mirage(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a subprocess in ``cwd``, importing mirage from this checkout."""
    path = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [sys.executable, "-m", "mirage_tui", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


USAGE_ERRORS = [
    (
        ["run", "--gpus-per-node", "0", "--", "python", "t.py"],
        "--gpus-per-node must be between 1 and 64, got 0",
    ),
    (
        ["run", "--gpus-per-node", "65", "--", "python", "t.py"],
        "--gpus-per-node must be between 1 and 64, got 65",
    ),
    (
        ["run", "--num-nodes", "0", "--", "python", "t.py"],
        "--num-nodes must be between 1 and 1024, got 0",
    ),
    (
        ["run", "--profile", "nope", "--", "python", "t.py"],
        "unknown profile 'nope'; choose one of: mi300x, mi325x, mi350x, mi355x",
    ),
    (["run"], "missing command: put the program after --"),
    (["run", "--"], "missing command: put the program after --"),
    (["run", "--env", "FOO", "--", "python", "t.py"], "--env expects KEY=VALUE, got 'FOO'"),
    (
        ["run", "--num-nodes", "abc", "--", "python", "t.py"],
        "argument --num-nodes: invalid int value: 'abc'",
    ),
    (
        ["run", "python", "t.py"],
        "unrecognized arguments: python t.py (the program to run goes after --)",
    ),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (
        ["run", "--program-clock", "emulated", "--", "python", "t.py"],
        "--program-clock emulated reads the emulated clock, which --exec-mode functional does not keep; "
        "add --exec-mode clocked or drop --program-clock",
    ),
    (
        ["run", "--exec-mode", "clocked", "--program-clock", "gpu", "--", "python", "t.py"],
        "argument --program-clock: invalid choice: 'gpu' (choose from 'wall', 'emulated')",
    ),
]


@pytest.mark.parametrize("args,problem", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_error_is_one_line_and_exit_2(tmp_path, args, problem):
    r = mirage(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("mirage: error: ")
    assert problem in lines[0]
    assert "--help" in lines[0]
    # Nothing started: no run directory, nothing at all written in cwd.
    assert list(tmp_path.iterdir()) == []


def test_run_errors_point_at_run_help(tmp_path):
    assert (
        "see 'mirage run --help'"
        in mirage(tmp_path, "run", "--gpus-per-node", "0", "--", "x").stderr
    )


def test_workload_flags_are_not_parsed(tmp_path):
    # "--gpus-per-node 0" after -- belongs to the workload, so only mirage's own
    # bad --num-nodes is reported.
    r = mirage(tmp_path, "run", "--num-nodes", "0", "--", "prog", "--gpus-per-node", "0", "--help")
    assert r.returncode == 2
    assert "--num-nodes" in r.stderr and "--gpus-per-node" not in r.stderr


def test_version(tmp_path):
    r = mirage(tmp_path, "--version")
    assert (r.returncode, r.stdout.strip()) == (0, "mirage 0.1.0")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["profiles", "--help"]])
def test_help(tmp_path, args):
    r = mirage(tmp_path, *args)
    assert r.returncode == 0 and r.stdout.startswith("usage: mirage")


def test_run_help_shows_flags(tmp_path):
    out = mirage(tmp_path, "run", "--help").stdout
    for flag in [
        "--profile",
        "--num-nodes",
        "--gpus-per-node",
        "--env",
        "--in-process",
        "--log-dir",
        "--exec-mode",
        "--program-clock",
    ]:
        assert flag in out


def test_profiles_table(tmp_path):
    r = mirage(tmp_path, "profiles")
    assert r.returncode == 0, r.stderr
    rows = {
        line.lstrip("* ").split()[0]: line
        for line in r.stdout.splitlines()
        if "AMD Instinct" in line
    }
    assert set(rows) == {"mi300x", "mi325x", "mi350x", "mi355x"}
    assert (
        "gfx942" in rows["mi300x"]
        and " 304 " in rows["mi300x"]
        and "192 GiB HBM3" in rows["mi300x"]
    )
    assert (
        "gfx950" in rows["mi350x"]
        and " 256 " in rows["mi350x"]
        and "288 GiB HBM3E" in rows["mi350x"]
    )
    # The default is marked, and only the default.
    assert rows["mi350x"].startswith("*")
    assert not any(rows[n].startswith("*") for n in rows if n != "mi350x")


def test_cli_imports_neither_textual_nor_torch(tmp_path):
    code = "import sys, mirage_tui.cli; print(sorted({'textual', 'torch'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.stdout.strip() == "[]", r.stderr


# ---------------------------------------------------------------- mirage-tui


def test_tui_validates_like_run_before_opening(capsys):
    # a usage error never gets as far as the console
    assert tui_main(["--num-nodes", "0", "--", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mirage-tui: error: --num-nodes")


def test_tui_batch_validates_like_run(capsys):
    assert tui_main(["--batch", "--gpus-per-node", "0", "--", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mirage-tui: error: --gpus-per-node")


# ---------------------------------------------------------------- topology


def test_parse_env():
    assert parse_env("A=b=c") == ("A", "b=c")
    assert parse_env("EMPTY=") == ("EMPTY", "")
    for bad in ["FOO", "=x", "1A=x", "A-B=x"]:
        with pytest.raises(UsageError):
            parse_env(bad)


def test_validate_accepts_defaults_with_a_command():
    topology = Topology(num_nodes=2, gpus_per_node=8, command=("python", "t.py"))
    validate(topology)
    assert topology.world_gpus == 16 and topology.profile == "mi350x"


def test_validate_checks_env_keys():
    with pytest.raises(UsageError, match="not a valid environment variable name"):
        validate(Topology(env=(("BAD KEY", "1"),), command=("x",)))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rank=1,seq=7", "expected rank=R,seq=N,action=hang|delay:2s|crash|skip"),
        ("rank=1,seq=7,action=explode", "unknown action 'explode'"),
        ("rank=x,seq=7,action=hang", "rank and seq must be whole numbers"),
        ("rank=1,seq=0,action=hang", "rank counts from 0 and seq from 1"),
    ],
)
def test_inject_usage_errors(tmp_path, spec, message):
    r = mirage(tmp_path, "run", "--inject", spec, "--", "python", "t.py")
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_status_of_something_that_is_not_a_run(tmp_path):
    r = mirage(tmp_path, "status", str(tmp_path))
    assert r.returncode == 2
    assert "is not a mirage run directory (it has no events.jsonl)" in r.stderr
    r = mirage(tmp_path, "status", "--log-dir", str(tmp_path / "none"))
    assert r.returncode == 2 and "no runs under" in r.stderr


def test_unwritable_log_dir_is_a_usage_error(tmp_path):
    r = mirage(tmp_path, "run", "--log-dir", "/proc/nope/runs", "--", "python", "-c", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("mirage: error: --log-dir /proc/nope/runs: cannot create a run directory there")
    assert len(r.stderr.splitlines()) == 1
