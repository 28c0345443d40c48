"""The fork server: a rank forked from it is the process its command line would have started.

Each check runs one command twice, as a fresh interpreter and handed over to a
real fork server (``python -m forkserver.server``, its stub a real
``sitecustomize``), and compares what the program saw and how it ended. Then,
in a session: ranks are forked, the program's own start-up order holds, and
nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_run import mirage_run, run_dir

REPO = Path(__file__).resolve().parent.parent

PROBE = r'''
import os, signal, sys, json
out = {
    "argv": sys.argv, "path0": sys.path[0], "file": globals().get("__file__"), "name": __name__,
    "cwd": os.getcwd(), "umask": os.umask(0o022), "env": os.environ.get("PROBE_VAR"),
    "line_buffering": sys.stdout.line_buffering, "write_through": sys.stdout.write_through,
    "encoding": sys.stdout.encoding, "sigint": str(signal.getsignal(signal.SIGINT)),
    "sighup": str(signal.getsignal(signal.SIGHUP)), "parent": os.getppid() == int(os.environ["PROBE_PARENT"]), "main_dict": sorted(k for k in globals() if k.startswith("__")),
}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A fork server, and the environment that hands a process over to it; one for the module's tests (its
    start imports torch and the rest of the preload: ~4.5 s of CPU). A forked rank is its own process, ended
    (and reaped) before its stub exits, so one test's ranks are gone when the next test starts."""
    tmp_path = tmp_path_factory.mktemp("fs")
    sock = str(tmp_path / "fs.sock")
    stubdir = tmp_path / "stub"
    stubdir.mkdir()
    (stubdir / "sitecustomize.py").write_text("from forkserver.handover import hand_over\nhand_over()\n")
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    base.pop("MIRAGE_SESSION", None)
    proc = subprocess.Popen([sys.executable, "-m", "forkserver.server", sock], env={**base, "MIRAGE_IS_FORK_SERVER": "1"},
                            cwd=REPO, stdin=subprocess.DEVNULL)
    while not os.path.exists(sock):
        assert proc.poll() is None, "the fork server ended before it listened"
        time.sleep(0.01)
    env = {**base, "PYTHONPATH": os.pathsep.join([str(stubdir), base["PYTHONPATH"]])}
    yield proc, {**env, "MIRAGE_FORK_SERVER": sock}, env
    proc.terminate()
    assert proc.wait(10) == 0


def both(server, args):
    """Run ``python ARGS`` fresh, then forked; return both CompletedProcesses."""
    _proc, served, fresh = server
    return [subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
            for env in (fresh, served)]


def forked_children(server_proc) -> list[psutil.Process]:
    return psutil.Process(server_proc.pid).children()


def test_a_script_sees_what_a_fresh_interpreter_shows_it(server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    link = tmp_path / "sub"
    link.mkdir()
    os.symlink(script, link / "linked.py")  # sys.path[0] is the folder of the file the link points to
    _proc, served, fresh = server
    for args in (["-u", str(link / "linked.py"), "a", "--b"], [str(script)], ["-c", PROBE, "x"],
                 ["-uc", PROBE, "y"]):
        outs = [subprocess.run([sys.executable, *args], env={**env, "PROBE_VAR": "v", "PROBE_PARENT": str(os.getpid())},
                               cwd=tmp_path,
                               capture_output=True, text=True, timeout=120) for env in (fresh, served)]
        assert outs[0].returncode == outs[1].returncode == 0, (outs[0].stderr, outs[1].stderr)
        assert outs[0].stdout == outs[1].stdout, args
        assert outs[1].stderr == ""


def test_a_module_runs_as_python_m_runs_it(server, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text(PROBE)
    _proc, served, fresh = server
    outs = [subprocess.run([sys.executable, "-m", "pkg.tool", "--flag"], env={**env, "PROBE_PARENT": str(os.getpid())},
                           cwd=tmp_path,
                           capture_output=True, text=True, timeout=120) for env in (fresh, served)]
    assert outs[0].stdout == outs[1].stdout and outs[0].returncode == outs[1].returncode == 0, outs[1].stderr
    assert '"argv": ["' + str(tmp_path / "pkg" / "tool.py") in outs[1].stdout


@pytest.mark.parametrize("body, code", [
    ("import sys; sys.exit(3)", 3),
    ("raise SystemExit('bye')", 1),
    ("def f():\n    raise ValueError('boom')\nf()", 1),
    ("import os; os.kill(os.getpid(), 9)", -9),
    ("raise KeyboardInterrupt", -2),
])
def test_it_ends_as_the_interpreter_would(server, tmp_path, body, code):
    script = tmp_path / "end.py"
    script.write_text("import atexit; atexit.register(print, 'atexit ran')\n" + body + "\n")
    fresh, forked = both(server, [str(script)])
    assert fresh.returncode == forked.returncode == code
    assert fresh.stdout == forked.stdout
    assert fresh.stderr == forked.stderr  # the traceback starts at the program's own frames


def test_signals_reach_the_rank_and_its_stub_passes_them_on(server, tmp_path):
    proc, served, _fresh = server
    script = tmp_path / "wait.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(7)))\n"
                      "print('ready', flush=True)\ntime.sleep(60)\n")
    stub = subprocess.Popen([sys.executable, str(script)], env=served, stdout=subprocess.PIPE, text=True)
    assert stub.stdout.readline() == "ready\n"
    (rank,) = forked_children(proc)
    assert rank.pid != stub.pid
    stub.send_signal(signal.SIGTERM)
    assert stub.wait(30) == 7
    assert stub.stdout.read() == "got TERM\n"


def test_a_stub_killed_takes_its_rank_with_it(server, tmp_path):
    proc, served, _fresh = server
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    stub = subprocess.Popen([sys.executable, str(script)], env=served, stdout=subprocess.PIPE, text=True)
    assert stub.stdout.readline() == "ready\n"
    (rank,) = forked_children(proc)
    stub.kill()
    stub.wait()
    rank.wait(10)  # raises psutil.TimeoutExpired if it is still running
    assert not forked_children(proc)


def test_its_open_files_come_along_at_their_numbers(server, tmp_path):
    _proc, served, _fresh = server
    r, w = os.pipe()
    script = tmp_path / "fd.py"
    script.write_text(f"import os\nos.write({w}, b'through the pipe')\n")
    stub = subprocess.run([sys.executable, str(script)], env=served, pass_fds=(w,), timeout=60)
    os.close(w)
    assert stub.returncode == 0
    assert os.read(r, 100) == b"through the pipe"
    os.close(r)


def test_what_it_cannot_serve_starts_fresh_with_one_line_saying_why(server, tmp_path):
    _proc, served, _fresh = server
    r = subprocess.run([sys.executable, "-X", "dev", "-c", "import sys; print(sys.flags.dev_mode)"], env=served,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "True\n"
    assert r.stderr == ("mirage: the fork server cannot start this process (interpreter options differ: dev_mode); "
                        "starting it as a new interpreter\n")
    r = subprocess.run([sys.executable, "-c", "import os; print(os.environ['TORCH_LOGS'])"],
                       env={**served, "TORCH_LOGS": "recompiles"}, capture_output=True, text=True, timeout=120)
    assert r.stdout == "recompiles\n" and "TORCH_LOGS differs from the session's" in r.stderr


def test_ranks_get_their_own_random_seeds(server, tmp_path):
    _proc, served, _fresh = server
    code = "import random, numpy; print(random.random(), numpy.random.rand())"
    outs = {subprocess.run([sys.executable, "-c", code], env=served, capture_output=True, text=True,
                           timeout=60).stdout for _ in range(3)}
    assert len(outs) == 3


FORKED = r'''
import os, psutil
parent = psutil.Process().parent().cmdline()  # the real one: os.getppid() answers the stub's parent
print("forked" if "forkserver.server" in parent else "fresh", os.environ["CUDA_VISIBLE_DEVICES"])
import torch
print("count", torch.cuda.device_count())
'''


@pytest.mark.usefixtures("no_orphans")
@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_session_forks_its_ranks_unless_told_not_to(tmp_path, mode):
    script = tmp_path / "where.py"
    script.write_text(FORKED)
    r = mirage_run(tmp_path / "runs", "--gpus-per-node", "2", "--nproc-per-node", "2", "--fork-server", mode,
                   "--env", "CUDA_VISIBLE_DEVICES=1", "--", "python", str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    how = "forked" if mode == "on" else "fresh"
    for rank in (0, 1):
        assert f"[{rank}] {how} 1" in r.stdout
        assert f"[{rank}] count 1" in r.stdout  # the shim activated at the program's import of torch
    assert (run_dir(tmp_path / "runs") / "forkserver.log").exists() == (mode == "on")


PRELOADED = r'''
import os, sys
preloaded = "shim.tensor.wrapper" in sys.modules  # a fresh rank imports it only as torch's import activates it
import torch
from shim.rank.runtime import RUNTIME
print("preloaded" if preloaded else "imported", "count", torch.cuda.device_count(), "device", RUNTIME.device is not None)
'''


@pytest.mark.usefixtures("no_orphans")
def test_a_forked_rank_finds_the_shim_loaded_and_builds_its_own_runtime(tmp_path):
    # the launcher (env) gives each rank a variable the session, and so the server, does not have: the
    # shim the server imported read the server's environment, and each rank rebuilds from its own
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    r = mirage_run(tmp_path / "runs", "--gpus-per-node", "2", "--nproc-per-node", "2", "--",
                   "env", "CUDA_VISIBLE_DEVICES=1", "python", str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fork server cannot start" not in r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[{rank}] preloaded count 1 device True" in r.stdout, r.stdout


def test_a_file_left_open_is_flushed_and_exit_hooks_run(server, tmp_path):
    script = tmp_path / "leave.py"
    out = tmp_path / "left-open.txt"
    script.write_text(f"import atexit\nf = open({str(out)!r}, 'w')\nf.write('every byte')\n"
                      "atexit.register(print, 'hook ran')\n")
    fresh, forked = both(server, [str(script)])
    assert fresh.stdout == forked.stdout == "hook ran\n"
    assert out.read_text() == "every byte"


def test_a_dead_weak_proxy_does_not_upset_the_end(server, tmp_path):
    script = tmp_path / "proxy.py"  # inductor leaves such proxies behind
    script.write_text("import weakref\nclass C: pass\nc = C()\np = weakref.proxy(c)\ndel c\nprint('done')\n")
    fresh, forked = both(server, [str(script)])
    assert fresh.returncode == forked.returncode == 0, forked.stderr
    assert fresh.stdout == forked.stdout == "done\n"
