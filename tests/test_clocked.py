"""Clocked mode (--exec-mode clocked, issue #16): real daemon, real ranks, emulated time."""

from __future__ import annotations

import time
import json
import re

import pytest
from test_run import FIXTURES, events, mirage_run, run_dir

import torch

from shim.clock.clock import Clock, _uncovered, _union
from wire.profiles import load_profile


def test_exposed_communication_is_what_compute_does_not_cover():
    compute = _union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert compute == [(0.0, 2.0), (3.0, 4.0)]
    comm = _union([(1.5, 3.5), (5.0, 6.0)])
    # 1.5-2.0 and 3.0-3.5 are hidden behind compute; 2.0-3.0 and 5.0-6.0 are not
    assert _uncovered(comm, compute) == pytest.approx(2.0)
    assert _uncovered([], compute) == 0.0
    assert _uncovered(comm, []) == pytest.approx(3.0)


def _on_gpu(n: int) -> torch.Tensor:
    """A stand-in for an emulated tensor of GPU 0 as the clock reads one: ``_gpu`` and its data, ``_elem``."""
    t = torch.empty(0)
    t._gpu, t._elem = 0, torch.ones(n)
    return t


def test_a_kernel_reading_a_collective_s_output_starts_when_the_collective_ends():
    """On any stream, and whichever way the op was priced; a kernel on other data does not wait."""
    aten = torch.ops.aten
    clock = Clock(load_profile("mi300x"))
    written, other, out = _on_gpu(4096), _on_gpu(4096), _on_gpu(4096)
    clock.collective_done(0, "comm", "nccl:all_reduce", 0.0, 1.0, {}, [written])
    clock.charge(aten.mul.Tensor, (other, 2.0), {}, out)
    assert clock.events[-1][4] == 0.0  # (kind, name, gpu, stream, start, ...)
    clock.charge(aten.mul.Tensor, (written, 2.0), {}, out)
    assert clock.events[-1][4] == 1.0
    clock.stream_of = lambda gpu: 7  # a stream still at 0, past which the collective ends
    clock.charge(aten._foreach_mul_.Scalar, ([other, written], 2.0), {}, None)
    assert clock.events[-1][3:5] == (7, 1.0)
    clock.stream_of = lambda gpu: 8
    clock.charge_priced(0, aten.add.Tensor, clock.costs.cost(aten.add.Tensor, (written, other), {}, out),
                        (other, written))
    assert clock.events[-1][3:5] == (8, 1.0)
    clock.stream_of = lambda gpu: 9
    clock.charge(aten.mul.Tensor, (other, 2.0), {}, out)
    assert clock.events[-1][3:5] == (9, 0.0)


@pytest.mark.usefixtures("no_orphans")
@pytest.mark.filterwarnings("ignore:The inplace keyword")  # HTA 0.5 on pandas 3
def test_clocked_ddp_reports_steps_and_timed_collectives(tmp_path):
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--gpus-per-node", "2", "--nproc-per-node", "2",
                   "--", "python", str(FIXTURES / "ddp_mlp.py"), steps=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] ddp_mlp_ok" in r.stdout.splitlines()
    ev = events(tmp_path)
    assert next(e for e in ev if e["type"] == "daemon_ready")["exec_mode"] == "clocked"
    steps = {rank: [e for e in ev if e["type"] == "clocked_step" and e["rank"] == rank] for rank in (0, 1)}
    for rank, mine in steps.items():
        assert [e["step"] for e in mine] == list(range(1, 11)), rank
        for e in mine:
            assert e["t_end"] > e["t_start"] >= 0
            assert e["compute_s"] > 0 and e["comm_s"] > 0 and 0 <= e["exposed_comm_s"] <= e["comm_s"] + 1e-12
            assert e["ops"] > 0
        assert all(a["t_end"] == b["t_start"] for a, b in zip(mine, mine[1:]))
    # DDP keeps the replicas in lockstep: both ranks finish each step together in emulated time
    assert [e["t_end"] for e in steps[0]] == pytest.approx([e["t_end"] for e in steps[1]], rel=1e-9)
    timed = [e for e in ev if e["type"] == "coll_completed"]
    assert timed and all(e["emulated_end"] > e["emulated_start"] and e["algo"] for e in timed)
    # what the user reads: the batch summary, report.json, the traces
    line = next(x for x in r.stderr.splitlines() if "predicted step" in x)
    assert line.startswith("mirage: clocked (mi350x): predicted step ") and "over steps 2-10" in line, line
    clocked = json.loads((run_dir(tmp_path) / "report.json").read_text())["clocked"]
    assert clocked["predicted_step_s"] > 0 and set(clocked["ranks"]) == {"0", "1"}
    assert clocked["predicted_step_s"] == pytest.approx(
        (steps[0][-1]["t_end"] - steps[0][0]["t_end"]) / 9, rel=1e-6)
    trace = run_dir(tmp_path) / "trace.json"
    assert f"mirage: trace: {trace} (open it in ui.perfetto.dev)" in r.stderr
    merged = json.loads(trace.read_text())
    assert merged["mirage"]["ranks"] == [0, 1] and not merged["mirage"]["skipped"]
    comms = [e for e in merged["traceEvents"] if e["name"].startswith("ncclDevKernel_AllReduce")]
    assert {e["pid"] for e in comms} == {1, 2}
    _hta_overlap(run_dir(tmp_path) / "traces")


def _hta_overlap(traces):
    """Holistic Trace Analysis reads the ranks' traces as a distributed job's and measures their overlap."""
    hta = pytest.importorskip("hta.trace_analysis")
    analysis = hta.TraceAnalysis(trace_dir=str(traces))
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    assert sorted(overlap["rank"]) == [0, 1]
    assert all(0 <= x <= 100 for x in overlap["comp_comm_overlap_pctg"])
    kernels = analysis.get_gpu_kernel_breakdown(visualize=False)[0]
    assert set(kernels["kernel_type"]) >= {"COMPUTATION", "COMMUNICATION"}
    # the per-iteration analyses read the host's ProfilerStep annotations and kernel launches
    temporal = analysis.get_temporal_breakdown(visualize=False)
    assert sorted(temporal["rank"]) == [0, 1] and all(temporal["compute_time(us)"] > 0)
    idle = analysis.get_idle_time_breakdown(visualize=False)[0]
    assert set(idle["idle_category"]) >= {"host_wait", "kernel_wait"}


@pytest.mark.usefixtures("no_orphans")
def test_functional_mode_keeps_no_clock(tmp_path):
    r = mirage_run(tmp_path, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "python",
                   str(FIXTURES / "ddp_mlp.py"), steps=3)
    assert r.returncode == 0, r.stdout + r.stderr
    ev = events(tmp_path)
    assert next(e for e in ev if e["type"] == "daemon_ready")["exec_mode"] == "functional"
    assert not [e for e in ev if e["type"] == "clocked_step"]
    assert all(e["emulated_end"] == 0 and not e["algo"] for e in ev if e["type"] == "coll_completed")


def test_clocked_in_process_is_refused(tmp_path):
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--in-process", "--", "python", "-c", "pass")
    assert r.returncode == 2
    assert "--exec-mode clocked needs the daemon" in r.stderr


def _timed_steps(stdout: str, rank: int) -> list[tuple[float, float]]:
    """(perf_counter, time.time) seconds of each step ``timed_steps.py``'s rank printed, in order."""
    out = []
    for line in stdout.splitlines():
        m = re.match(rf"\[{rank}\] \[rank {rank}\] step \d+: perf_counter (\S+) s, time\.time (\S+) s, ", line)
        if m:
            out.append((float(m.group(1)), float(m.group(2))))
    return out


@pytest.mark.usefixtures("no_orphans")
def test_program_clock_emulated_prints_the_prediction(tmp_path):
    """--program-clock emulated: a step timed with perf_counter/time.time around synchronize() is the prediction."""
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--program-clock", "emulated", "--gpus-per-node", "2",
                   "--nproc-per-node", "2", "--", "python", str(FIXTURES / "timed_steps.py"), steps=6)
    assert r.returncode == 0, r.stdout + r.stderr
    ev = events(tmp_path)
    clocked = json.loads((run_dir(tmp_path) / "report.json").read_text())["clocked"]
    for rank in (0, 1):
        printed = _timed_steps(r.stdout, rank)
        steps = [e for e in ev if e["type"] == "clocked_step" and e["rank"] == rank]
        assert len(printed) == len(steps) == 6, r.stdout
        # the first step also holds what came before it on the rank's clock (the model's copy, DDP's broadcast);
        # from the second on, the program's clock reads each step's emulated time
        for (perf, wall), e in zip(printed[1:], steps[1:]):
            # within 10 ns: a read is at least 1 ns after the thread's previous one, and the loop reads the clock
            # twice (time.time, then the next step's perf_counter) while the host stands still
            assert perf == pytest.approx(e["t_end"] - e["t_start"], rel=0, abs=1e-8)
            assert wall == pytest.approx(perf, rel=2e-3)  # time.time()'s float keeps ~0.2 µs
        assert sum(p for p, _ in printed[1:]) / 5 == pytest.approx(clocked["predicted_step_s"], rel=0, abs=1e-8)


@pytest.mark.usefixtures("no_orphans")
def test_program_clock_wall_is_the_cpus(tmp_path):
    """--program-clock wall (the default): the program's clock is the CPU's, far from the prediction."""
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--program-clock", "wall", "--", "python",
                   str(FIXTURES / "timed_steps.py"), steps=4)
    assert r.returncode == 0, r.stdout + r.stderr
    predicted = json.loads((run_dir(tmp_path) / "report.json").read_text())["clocked"]["predicted_step_s"]
    printed = _timed_steps(r.stdout, 0)
    assert len(printed) == 4 and predicted > 0
    assert all(perf > 3 * predicted for perf, _ in printed), (printed, predicted)


@pytest.mark.usefixtures("no_orphans")
def test_program_clock_emulated_keeps_waits_real(tmp_path):
    """Timeouts inside the standard library stay wall time; the program's sleeps move its clock."""
    r = mirage_run(tmp_path, "--exec-mode", "clocked", "--program-clock", "emulated", "--", "python",
                   str(FIXTURES / "clock_waits.py"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] clock_waits_ok" in r.stdout.splitlines()
    took = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^\[0\] (\w+): wall (\S+) program (\S+)$", r.stdout, re.M)}
    assert set(took) == {"condition", "event", "lock", "queue", "mp_queue", "sleep", "deadline_loop", "asyncio",
                         "futures", "subprocess"}
    for what, (wall, _) in took.items():
        assert 0.19 < wall < 5, (what, wall)
    assert took["sleep"][1] == pytest.approx(0.2, abs=1e-6)
    assert 0.3 <= took["deadline_loop"][1] < 0.36
    assert took["event"][1] < 1e-6  # a wait that timed out is not a sleep: the program's clock did not move


def test_the_program_clock_reads_strictly_later_and_is_real_once_uninstalled():
    from shim.clock import program_clock

    # two readings with no emulated time between them differ, even on time.time()'s large base
    first = program_clock._strictly_after("time", 1.7e9)
    assert program_clock._strictly_after("time", 1.7e9) > first
    assert program_clock._strictly_after("time_ns", 1_700_000_000_000_000_000) == 1_700_000_000_000_000_000
    assert program_clock._strictly_after("time_ns", 1_700_000_000_000_000_000) == 1_700_000_000_000_000_001
    # not installed (a fork's child holding names bound with `from time import time`): the real clocks
    assert not program_clock._installed
    assert abs(program_clock._PATCHES["time"]() - time.time()) < 1.0
