"""``mirage profiles``, ``profiles show`` and ``profiles create``, and user profiles in a run.

Every case runs the real CLI (``python -m mirage_tui``) with ``XDG_CONFIG_HOME``
in tmp_path, so user profiles are written and read there and never in the
home directory of whoever runs the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from wire.profiles import PROFILE_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTINS = ["mi300x", "mi325x", "mi350x", "mi355x"]


def mirage(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``mirage ARGS`` with user profiles under ``tmp_path/config`` and the venv's tools on PATH."""
    env = dict(os.environ)
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "mirage_tui", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )


def user_dir(tmp_path: Path) -> Path:
    return tmp_path / "config" / "mirage" / "profiles"


def usage_error(r: subprocess.CompletedProcess[str]) -> str:
    """The one ``mirage: error:`` line of a usage error (exit 2), without its prefix."""
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("mirage: error: ")
    return line.removeprefix("mirage: error: ")


def test_show_prints_every_field_aligned(tmp_path):
    r = mirage(tmp_path, "profiles", "show", "MI350X")
    assert r.returncode == 0, r.stderr
    head, *lines = r.stdout.splitlines()
    assert head == f"mi350x: built-in profile, {PROFILE_DIR / 'mi350x.toml'}"
    fields = tomllib.loads((PROFILE_DIR / "mi350x.toml").read_text())
    assert [line.split()[0] for line in lines] == list(fields)
    # every value starts in one column
    assert len({len(line) - len(line.split(None, 1)[1]) for line in lines}) == 1
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    assert rows["hbm_bytes"] == "309237645312  (288 GiB)"
    assert rows["product"] == "AMD Instinct MI350X" and rows["fp16_tflops"] == "2300.0"


def test_json_list_and_show(tmp_path):
    r = mirage(tmp_path, "profiles", "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert [p["name"] for p in listed] == BUILTINS
    assert {p["source"] for p in listed} == {"built-in"}
    r = mirage(tmp_path, "profiles", "show", "mi300x", "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown == listed[0]
    assert shown["hbm_bytes"] == 192 * 2**30 and shown["fp16_tflops"] == 1307.4
    assert shown["file"] == str(PROFILE_DIR / "mi300x.toml")
    # --json before 'show' holds too
    assert json.loads(mirage(tmp_path, "profiles", "--json", "show", "mi300x").stdout) == shown


def test_create_then_list_and_show(tmp_path):
    r = mirage(tmp_path, "profiles", "create", "small", "--from", "mi350x", "--hbm", "96GiB",
               "--set", "compute_units=128", "--set", "hbm_tbps=4", "--set", "product=Small GPU")
    assert r.returncode == 0, r.stderr
    path = user_dir(tmp_path) / "small.toml"
    assert str(path) in r.stdout
    text = path.read_text()
    assert text.startswith("# mirage user profile 'small', made by 'mirage profiles create' from 'mi350x'")
    data = tomllib.loads(text)
    assert data["name"] == "small" and data["compute_units"] == 128 and data["hbm_tbps"] == 4.0
    assert data["hbm_bytes"] == 96 * 2**30 and data["product"] == "Small GPU"
    assert data["gfx"] == "gfx950"  # the rest is mi350x's

    r = mirage(tmp_path, "profiles")
    assert r.returncode == 0, r.stderr
    (row,) = [line for line in r.stdout.splitlines() if line.split()[:1] == ["small"]]
    assert "96 GiB HBM3E" in row and " 128 " in row and row.endswith(f"user: {path}")
    assert [p["name"] for p in json.loads(mirage(tmp_path, "profiles", "--json").stdout)] == [*BUILTINS, "small"]

    shown = json.loads(mirage(tmp_path, "profiles", "show", "small", "--json").stdout)
    assert (shown["source"], shown["file"], shown["hbm_bytes"]) == ("user", str(path), 96 * 2**30)
    r = mirage(tmp_path, "profiles", "show", "small")
    assert r.stdout.splitlines()[0] == f"small: user profile, {path}"

    # a user profile can be the base of another
    assert mirage(tmp_path, "profiles", "create", "smaller", "--from", "small", "--hbm", "8GiB").returncode == 0
    assert tomllib.loads((user_dir(tmp_path) / "smaller.toml").read_text())["compute_units"] == 128


def test_create_refuses_to_overwrite_without_force(tmp_path):
    assert mirage(tmp_path, "profiles", "create", "mine", "--from", "mi300x").returncode == 0
    path = user_dir(tmp_path) / "mine.toml"
    assert usage_error(mirage(tmp_path, "profiles", "create", "mine", "--from", "mi350x")) == (
        f"{path} already exists; pass --force to overwrite it"
    )
    assert tomllib.loads(path.read_text())["gfx"] == "gfx942"
    assert mirage(tmp_path, "profiles", "create", "mine", "--from", "mi350x", "--force").returncode == 0
    assert tomllib.loads(path.read_text())["gfx"] == "gfx950"


@pytest.mark.parametrize(
    "args,error",
    [
        (["mi350x", "--from", "mi300x"], "'mi350x' is a built-in profile; choose another name"),
        (["My.GPU", "--from", "mi300x"],
         "a profile name is a lower-case letter, then letters, digits, '-' or '_' (64 at most), got 'My.GPU'"),
        (["x", "--from", "h100"], "unknown profile 'h100'; choose one of: mi300x, mi325x, mi350x, mi355x"),
        (["x", "--from", "mi300x", "--set", "flux_capacitors=3"], "unknown field 'flux_capacitors'; choose one of: name,"),
        (["x", "--from", "mi300x", "--set", "compute_units=many"], "field 'compute_units' must be int, got 'many'"),
        (["x", "--from", "mi300x", "--set", "hbm_tbps=-1"],
         "field 'hbm_tbps' must be a finite number of at least 0, got '-1'"),
        (["x", "--from", "mi300x", "--set", "compute_units"],
         "--set expects FIELD=VALUE, e.g. --set compute_units=128, got 'compute_units'"),
        (["x", "--from", "mi300x", "--set", "name=y"], "field 'name' is the new profile's NAME; set it there"),
        (["x", "--from", "mi300x", "--hbm", "8GiB", "--set", "hbm_bytes=8"],
         "--hbm and --set hbm_bytes=... both set hbm_bytes; give one of them"),
        (["x", "--from", "mi300x", "--hbm", "lots"], "--hbm expects a size such as 8GiB, 512MiB or 80GB, got 'lots'"),
        (["x"], "the following arguments are required: --from; see 'mirage profiles create --help'"),
    ],
)
def test_create_usage_errors(tmp_path, args, error):
    assert usage_error(mirage(tmp_path, "profiles", "create", *args)).startswith(error)
    assert not user_dir(tmp_path).exists() or not list(user_dir(tmp_path).iterdir())


def test_show_unknown_name(tmp_path):
    assert usage_error(mirage(tmp_path, "profiles", "show", "h100")) == (
        "unknown profile 'h100'; choose one of: mi300x, mi325x, mi350x, mi355x"
    )


def test_malformed_user_profile_names_file_and_field(tmp_path):
    user_dir(tmp_path).mkdir(parents=True)
    bad = user_dir(tmp_path) / "bad.toml"
    bad.write_text((PROFILE_DIR / "mi350x.toml").read_text()
                   .replace('name = "mi350x"', 'name = "bad"').replace("compute_units = 256", 'compute_units = "256"'))
    want = f"{bad}: field 'compute_units' must be int, got str"
    assert usage_error(mirage(tmp_path, "profiles")) == want
    assert usage_error(mirage(tmp_path, "profiles", "show", "bad")) == want
    assert usage_error(mirage(tmp_path, "run", "--profile", "bad", "--", "python", "t.py")).startswith(want)
    # the other profiles still work one by one
    assert mirage(tmp_path, "profiles", "show", "mi350x").returncode == 0


def test_user_profile_must_match_its_file_name(tmp_path):
    user_dir(tmp_path).mkdir(parents=True)
    copy = user_dir(tmp_path) / "copy.toml"
    copy.write_text((PROFILE_DIR / "mi350x.toml").read_text())
    assert usage_error(mirage(tmp_path, "profiles", "show", "copy")) == (
        f"{copy}: field 'name' is 'mi350x', but the file is named for 'copy'"
    )


def test_user_profile_may_not_shadow_a_builtin(tmp_path):
    user_dir(tmp_path).mkdir(parents=True)
    shadow = user_dir(tmp_path) / "MI300X.toml"
    shadow.write_text((PROFILE_DIR / "mi300x.toml").read_text())
    want = f"{shadow}: a user profile may not shadow the built-in profile 'mi300x'; rename the file"
    assert usage_error(mirage(tmp_path, "profiles")) == want
    assert usage_error(mirage(tmp_path, "profiles", "show", "mi300x")) == want


@pytest.mark.usefixtures("no_orphans")
def test_run_with_user_profile_reports_its_hbm(tmp_path):
    assert mirage(tmp_path, "profiles", "create", "lab", "--from", "mi350x", "--hbm", "96GiB",
                  "--set", "product=Lab GPU").returncode == 0
    code = "import torch; p = torch.cuda.get_device_properties(0); print('hbm', p.total_memory, p.name)"
    # the ranks get the profile's file: a rank whose XDG_CONFIG_HOME differs still loads it
    r = mirage(tmp_path, "run", "--log-dir", str(tmp_path / "runs"), "--profile", "lab", "--gpus-per-node", "1",
               "--env", "XDG_CONFIG_HOME=/nonexistent", "--", "python", "-c", code, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"[0] hbm {96 * 2**30} Lab GPU" in r.stdout.splitlines()


def test_a_reader_that_stops_early_ends_it_quietly(tmp_path):
    """``mirage profiles show mi350x | head -1``: no BrokenPipeError traceback, SIGPIPE's exit status."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "mirage_tui", "profiles", "show", "mi350x"], env=env,
                           stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert r.returncode == 141, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
