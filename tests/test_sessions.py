"""Live sessions (issue #19): `mirage sessions`, `mirage stop`, `mirage-tui --attach`, with real runs.

Each test gives its runs and commands a registry of their own (``XDG_RUNTIME_DIR`` under
``tmp_path``), so sessions of other tests running beside it are not listed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run import FIXTURES, REPO_ROOT

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.usefixtures("no_orphans")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), **extra)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.pop("NO_COLOR", None)
    return env


def _mirage(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "mirage"), *args], cwd=REPO_ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def _start_long_run(tmp_path: Path, leave_a_process: bool = False) -> subprocess.Popen:
    """A headless 2-GPU DDP run that trains until it is stopped; ``leave_a_process``: its node command
    also starts a background sleeper that nothing reaps if the owner is killed (what cleanup is for)."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", str(FIXTURES / "ddp_mlp.py")]
    flags = []
    if leave_a_process:
        torchrun = ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(300)' & exec {' '.join(torchrun)}"]
        flags = ["--fork-server", "off"]  # a forked sleeper would end with the fork server, escaping nothing
    return subprocess.Popen(
        [str(BIN / "mirage"), "run", "--log-dir", str(tmp_path / "runs"), "--gpus-per-node", "2", *flags, "--",
         *torchrun],
        cwd=REPO_ROOT, env=_env(tmp_path, STEPS="10000000"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )


def _listed(tmp_path: Path, *flags: str) -> list[dict]:
    r = _mirage(tmp_path, "sessions", "--json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _until(what: str, condition, timeout: float = 90, seen=lambda: ""):
    """``condition()``'s first true value; fails after ``timeout`` s, showing ``seen()``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}; saw:\n{seen()}"
        time.sleep(0.2)


def _training(tmp_path: Path) -> dict:
    """The one live session, once both ranks registered and it is training."""
    def ready():
        live = _listed(tmp_path)
        return live[0] if live and live[0]["state"] in ("running", "in collective") else None
    return _until("the run to be listed as training", ready)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)


def test_a_headless_run_is_listed_and_stopped_as_ctrl_c_would(tmp_path):
    proc = _start_long_run(tmp_path)
    try:
        entry = _training(tmp_path)
        assert entry["pid"] == proc.pid and entry["num_nodes"] == 1 and entry["gpus_per_node"] == 2
        assert entry["profile"] == "mi350x" and entry["command"][0] == "torchrun"
        assert Path(entry["run_dir"], "session.json").is_file()
        table = _mirage(tmp_path, "sessions").stdout.splitlines()
        assert table[0].split() == ["SESSION", "STATE", "AGE", "PID", "TOPOLOGY", "PROFILE", "COMMAND"]
        assert table[1].startswith(entry["session"]) and "1x2" in table[1] and "ddp_mlp.py" in table[1]
        # a probe in the session's environment on node 0: its GPUs, but not its process groups
        probe = ("import torch; x = torch.ones(4, device='cuda'); "
                 "print(torch.cuda.device_count(), torch.cuda.get_device_name(0), (x * 2).sum().item(), x.device)")
        r = _mirage(tmp_path, "exec", entry["session"], "--", sys.executable, "-c", probe)
        assert r.returncode == 0 and r.stdout.split("\n")[0] == "2 AMD Instinct MI350X 8.0 cuda:0", r.stdout + r.stderr
        # (a fresh-clone suite once saw the owner gone at the next exec: say how it ended if so)
        assert proc.poll() is None, f"the run ended during the probe: {proc.communicate(timeout=30)[1][-3000:]}"
        r = _mirage(tmp_path, "exec", entry["session"], "--", sys.executable, "-c",
                    "import torch.distributed as d; d.init_process_group('nccl')")
        assert r.returncode == 1 and "may not join the job's process groups" in r.stderr, r.stderr
        r = _mirage(tmp_path, "exec", entry["session"], "--node", "1", "--", "true")
        assert r.returncode == 2 and "--node must be 0-0" in r.stderr
        r = _mirage(tmp_path, "stop", entry["session"][:4])  # a unique prefix names it
        assert r.returncode == 0, r.stderr
        assert f"session {entry['session']} ended" in r.stderr
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted by SIGINT" in err
        assert _listed(tmp_path) == [] and _listed(tmp_path, "--all") == []
        assert not list(Path(entry["run_dir"]).glob("node-*.env.json"))  # they hold the token: gone with it
        events = [json.loads(line) for line in Path(entry["run_dir"], "events.jsonl").read_text().splitlines()]
        assert sorted(e["rank"] for e in events if e["type"] == "rank_registered") == [0, 1]  # exec is no rank
        report = json.loads(Path(entry["run_dir"], "report.json").read_text())
        assert report["returncode"] == 130
    finally:
        _reap(proc)


def test_a_killed_owner_leaves_a_dead_session_that_cleanup_removes(tmp_path):
    proc = _start_long_run(tmp_path, leave_a_process=True)
    try:
        entry = _training(tmp_path)
        # killed once rank 0's output reached its log: the kill must not race the log the test expects kept
        _until("rank 0's output in its log", lambda: (Path(entry["run_dir"]) / "rank-0.log").exists())
        os.kill(proc.pid, signal.SIGKILL)  # the owner only: its ranks die with it (PR_SET_PDEATHSIG)
        proc.communicate(timeout=30)
        _until("the session to be gone from the live list", lambda: _listed(tmp_path) == [])
        dead = _listed(tmp_path, "--all")
        assert [(d["session"], d["state"]) for d in dead] == [(entry["session"], "dead")]
        r = _mirage(tmp_path, "stop", entry["session"])
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
        assert "is not live" in r.stderr and "mirage cleanup" in r.stderr
        run_dir = Path(entry["run_dir"])
        listed = _mirage(tmp_path, "cleanup", "--dry-run")
        assert listed.returncode == 0, listed.stderr
        kinds = {line.split()[3] for line in listed.stdout.splitlines()}  # "would remove <session> <kind>"
        assert {"process", "socket", "token", "run", "registry"} <= kinds, listed.stdout
        assert "time.sleep(300)" in listed.stdout  # the sleeper the node's shell left, found by its session id
        assert _listed(tmp_path, "--all") != []  # a dry run removes nothing
        cleaned = _mirage(tmp_path, "cleanup")
        assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
        assert all(line.startswith("removed ") for line in cleaned.stdout.splitlines()), cleaned.stdout
        assert _listed(tmp_path, "--all") == []
        assert not list(run_dir.glob("*.sock")) and not (run_dir / "token").exists()
        report = json.loads((run_dir / "report.json").read_text())
        assert report["returncode"] == 137 and "was killed" in report["summary"]
        last = json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])
        assert last["type"] == "session_ended" and last["returncode"] == 137
        assert (run_dir / "rank-0.log").read_text()  # the logs are kept
        assert "nothing to clean up" in _mirage(tmp_path, "cleanup").stderr
    finally:
        _reap(proc)

def test_bad_session_names_are_one_line_usage_errors(tmp_path):
    for args, words in ((("stop", "feedbeef"), "no live session 'feedbeef'"),
                        (("sessions", "extra"), "unrecognized arguments")):
        r = _mirage(tmp_path, *args)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    tui = subprocess.run([str(BIN / "mirage-tui"), "--attach", "tests/fixtures/runs/ddp-2gpu"], cwd=REPO_ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert tui.returncode == 2 and "has no session.json" in tui.stderr and len(tui.stderr.splitlines()) == 1
    tui = subprocess.run([str(BIN / "mirage-tui"), "--attach"], cwd=REPO_ROOT, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert tui.returncode == 2 and "no live mirage session" in tui.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_attach_from_a_second_console_under_tmux_then_detach(tmp_path):
    proc = _start_long_run(tmp_path)
    name = f"mirage-attach-{os.getpid()}"
    env = _env(tmp_path)
    try:
        entry = _training(tmp_path)
        # the pause lets tmux give the window its size before the console reads it (under load a
        # console started at once was seen drawing for 80x24 in a 140x45 pane)
        command = (f"sleep 1; XDG_RUNTIME_DIR={env['XDG_RUNTIME_DIR']} {BIN / 'mirage-tui'} --attach; "
                   f"echo ATTACH-EXIT=$?; sleep 60")
        # a tmux server of its own (-L): its windows get this test's environment, not an older server's
        subprocess.run(["tmux", "-L", name, "new-session", "-d", "-s", name, "-x", "140", "-y", "45", command],
                       check=True, cwd=REPO_ROOT, env=env)
        subprocess.run(["tmux", "-L", name, "resize-window", "-t", name, "-x", "140", "-y", "45"], capture_output=True)

        def screen() -> str:
            return subprocess.run(["tmux", "-L", name, "capture-pane", "-p", "-t", name], capture_output=True,
                                  text=True).stdout

        shown = _until("the attached console to show both ranks training", lambda: (
            (text := screen()) and f"attached to session {entry['session']}" in text
            and "rank 1 gpu 1" in text and "ALLREDUCE" in text and text), timeout=150, seen=screen)
        assert "training on cuda:0" in shown  # rank 0's output, from the start of the run
        subprocess.run(["tmux", "-L", name, "send-keys", "-t", name, "q"], check=True)
        _until("the console to detach", lambda: "ATTACH-EXIT=0" in screen(), seen=screen)
        time.sleep(1)
        assert proc.poll() is None, "detaching stopped the run"
        assert [e["session"] for e in _listed(tmp_path)] == [entry["session"]]
    finally:
        subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True)
        _reap(proc)


def test_an_attached_console_kills_a_rank_and_sees_the_run_end(tmp_path, monkeypatch):
    """The same keys as a run the console started: k kills the selected rank (after a yes)."""
    pytest.importorskip("textual")
    import asyncio

    from mirage_tui.app.app import MirageApp
    from mirage_tui.app.confirm import ConfirmScreen
    from mirage_tui.app.ranks_pane import RankTree
    from mirage_tui.app.report import ReportScreen
    from mirage_tui.session import registry as sessions

    proc = _start_long_run(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", _env(tmp_path)["XDG_RUNTIME_DIR"])
    try:
        _training(tmp_path)
        app = MirageApp(attach=sessions.find(None))

        async def body() -> None:
            async with app.run_test(size=(140, 45)) as pilot:
                run = app.run_screen
                for _ in range(600):
                    if len(run.query_one(RankTree).rank_items) == 2:
                        break
                    await pilot.pause(0.1)
                run.query_one("#ranks").select_node(run.query_one(RankTree).rank_items[1])
                await pilot.pause(0.2)
                await pilot.press("k")
                await pilot.pause(0.2)
                assert isinstance(app.screen, ConfirmScreen)
                await pilot.press("y")
                for _ in range(900):
                    if isinstance(app.screen, ReportScreen):
                        break
                    await pilot.pause(0.1)
                assert isinstance(app.screen, ReportScreen), "the run's end never reached the attached console"
                await pilot.press("q")

        asyncio.run(body())
        assert app.outcome is not None and app.outcome.returncode != 0
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "rank 1" in err, err
    finally:
        _reap(proc)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (.ci/run installs it)")
def test_attach_served_to_a_real_browser_needs_the_token(tmp_path):
    """`--attach S --serve PORT`: headless Chromium opens the printed URL and shows the run screen."""
    pytest.importorskip("textual_serve")
    import asyncio
    import re

    import aiohttp
    from browser import screenshot
    from test_tui_serve import _free_port

    proc = _start_long_run(tmp_path)
    port = _free_port()
    server = None
    try:
        entry = _training(tmp_path)
        log = open(tmp_path / "serve.log", "w")
        server = subprocess.Popen([str(BIN / "mirage-tui"), "--attach", "--serve", f"127.0.0.1:{port}"],
                                  cwd=REPO_ROOT, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        url = _until("the served URL", lambda: (m := re.search(r"http://\S+/\?token=[0-9a-f]+",
                                                                 (tmp_path / "serve.log").read_text())) and m[0])
        assert url.startswith(f"http://127.0.0.1:{port}/?token=")

        async def status(path: str) -> int:
            async with aiohttp.ClientSession() as http:
                for _ in range(100):
                    try:
                        async with http.get(f"http://127.0.0.1:{port}{path}") as r:
                            return r.status
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.1)
            raise AssertionError("the server never answered")

        assert asyncio.run(status("/")) == 403
        assert asyncio.run(status("/ws?token=0123")) == 403
        # the intro splash is about 17 KB; the run screen's text and borders several times that
        png = screenshot(url, tmp_path / "chromium", lambda p: len(p) > 50_000, timeout=90)
        (tmp_path / "served.png").write_bytes(png)
        assert len(png) > 50_000, f"the browser never showed more than textual-serve's intro ({tmp_path}/served.png)"
        # aiohttp logs a websocket when it closes: once the browser is gone
        _until("the browser's websocket in the server's log", lambda: re.search(
            r'"GET /ws\?width=\d+&height=\d+\s+HTTP/1.1" 101', (tmp_path / "serve.log").read_text()), timeout=30)
        assert proc.poll() is None  # the browser's console detached; the run goes on
        assert [e["session"] for e in _listed(tmp_path)] == [entry["session"]]
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        _reap(proc)


def test_attach_without_a_name_offers_a_picker_when_several_are_live(tmp_path, monkeypatch):
    pytest.importorskip("textual")
    import asyncio

    from textual.widgets import OptionList

    from mirage_tui.app.app import MirageApp
    from mirage_tui.app.feeds import AttachFeed
    from mirage_tui.app.session_picker import SessionPicker
    from mirage_tui.session import registry as sessions

    first = _start_long_run(tmp_path)
    second = _start_long_run(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", _env(tmp_path)["XDG_RUNTIME_DIR"])
    try:
        _until("two live sessions", lambda: len(sessions.live()) == 2)
        live = sessions.live()
        app = MirageApp(pick=live)

        async def body() -> None:
            async with app.run_test(size=(140, 45)) as pilot:
                await pilot.pause(0.2)
                assert isinstance(app.screen, SessionPicker)
                options = app.screen.query_one(OptionList)
                assert options.option_count == 2
                newest = max(live, key=lambda e: e.started)
                assert options.get_option_at_index(0).id == newest.session  # newest first
                await pilot.press("down", "enter")
                await pilot.pause(0.3)
                assert isinstance(app.run_screen.feed, AttachFeed)
                assert app.run_screen.feed.entry.session == min(live, key=lambda e: e.started).session
                await pilot.press("q")  # detaches

        asyncio.run(body())
        assert app.return_code == 0 and first.poll() is None and second.poll() is None
    finally:
        _reap(first)
        _reap(second)
