"""The report on a finished run, read off its fold: as text (the Report screen) and as JSON (``report.json``).

No Textual here: the Report screen only colours the text's first line.
"""

from __future__ import annotations

import json
import os
import sys

from mirage_tui.config.rundir import RunDir
from mirage_tui.config.topology import Topology
from mirage_tui.glyphs import human_bytes, human_seconds
from mirage_tui.state.runstate import Outcome, RunState
from wire.schema import HangKind


def clocked_line(state: RunState, profile: str = "") -> str:
    """A clocked (or estimate) run's prediction in one line (batch mode prints it after ``mirage: ``)."""
    head = f"{'estimate' if state.exec_mode == 'estimate' else 'clocked'} ({state.profile or profile})"
    p = state.prediction()
    if p is None:
        return f"{head}: no rank reported an optimizer step, so there is no step time to predict"
    steps = f"step {p.last_step}" if p.first_measured == p.last_step else f"steps {p.first_measured}-{p.last_step}"
    return (f"{head}: predicted step {human_seconds(p.step_s)} (compute {human_seconds(p.compute_s)}, "
            f"communication {human_seconds(p.comm_s)}, exposed {human_seconds(p.exposed_comm_s)}) over {steps}, "
            f"slowest rank {p.slowest_rank}")


def _clocked_lines(state: RunState) -> list[str]:
    """The Report screen's clocked section: the prediction, then each rank's figures."""
    out = ["", clocked_line(state)]
    for c in state.rank_clocks().values():
        out.append(f"  rank {c.rank}  step {human_seconds(c.step_s):>8} (last {human_seconds(c.last_step_s)})  "
                   f"compute {human_seconds(c.compute_s)}  comm {human_seconds(c.comm_s)}  "
                   f"exposed {human_seconds(c.exposed_comm_s)}  {c.steps} steps")
    p = state.prediction()
    if p is not None:
        if p.first_measured > 1:
            out.append("  means over every step after the first (warm-up)")
        if p.bytes_only_ops:
            out.append(f"  {p.bytes_only_ops} of {p.ops} ops were costed by their bytes alone (no FLOP formula)")
    return out


def _comm_lines(state: RunState) -> list[str]:
    """The Report screen's communicators: collectives completed, their bytes, the ranks' waiting, the slowest rank."""
    out = ["", "communicators"]
    width = max((len(c.title) for c in state.comms.values()), default=0)
    for c in state.comms.values():
        line = (f"  {c.title:<{width}}  {c.size} ranks  {c.collectives:>6} collectives  "
                f"{human_bytes(c.bytes_done):>10}  waited {human_seconds(c.wait_s)}")
        slowest = c.slowest_rank
        if slowest is not None:
            line += f"  slowest rank {slowest} (last at {c.last_arrivals[slowest]} of {sum(c.last_arrivals.values())})"
        out.append(line + (", FAILED" if c.failed else ""))
    if not state.comms:
        out.append("  (no communicator)")
    else:
        out.append("  waited: summed over ranks, from each rank's post to the collective's start")
    return out


def render(state: RunState, outcome: Outcome, run_dir: str, skipped: int = 0) -> str:
    """The report as plain text lines: exit codes, durations, findings, log paths."""
    paths = RunDir(path=run_dir, session="", token="")  # only its path-naming rules are used
    status = "ok" if outcome.returncode == 0 else "FAILED"
    out = [f"run {status}: exit {outcome.returncode}", f"  {outcome.summary}"]
    began = state.began_at
    if began is not None:
        out.append(f"  duration {state.last_t - began:.1f} s, {state.events} events")
    out.append(f"  run dir: {run_dir}")
    out += ["", "nodes"]
    for node, code in sorted(state.node_exits.items()):
        out.append(f"  node {node}  exit {code:<4} log {paths.node_log(node)}")
    if not state.node_exits:
        out.append("  (no node process exited)")
    out += ["", "ranks"]
    ranks = state.registered
    for rank, r in ranks.items():
        assert r.registered_at is not None  # registered
        ran = f"{r.ended_at - r.registered_at:6.1f} s" if r.ended_at is not None else "  (no end)"
        peak = f"peak {human_bytes(r.peak_memory):>9}  " if r.peak_memory else ""
        host = f"on {r.host}  " if r.host and len({x.host for x in ranks.values()}) > 1 else ""
        out.append(f"  rank {rank}  node {r.node}  {host}pid {r.pid:<7} ran {ran}  {peak}log {paths.rank_log(rank)}")
    if not ranks:
        out.append("  (no rank registered)")
    out += _comm_lines(state)
    if state.clocked:
        out += _clocked_lines(state)
    out += ["", "findings"]
    out += [f"  {f.kind}: {f.text}" for f in state.findings] or ["  none"]
    if skipped:
        out += ["", f"{skipped} unreadable line(s) of events.jsonl were skipped"]
    return "\n".join(out)


def to_json(state: RunState, topology: Topology, outcome: Outcome | None, run: RunDir) -> dict:
    """The run in one document: topology, outcome, node and rank exits, communicators, memory, hangs;
    in a clocked run, its step times in emulated time (``clocked``; absent from a functional run's)."""
    topo, st = topology, state
    doc = {
        "run_dir": run.path,
        "topology": {
            "profile": topo.profile, "num_nodes": topo.num_nodes, "gpus_per_node": topo.gpus_per_node,
            "command": list(topo.command), "env": dict(topo.env), "in_process": topo.in_process,
            "hang_timeout_s": topo.hang_timeout_s, "faults": [f.spec() for f in topo.faults],
        },
        "returncode": None if outcome is None else outcome.returncode,
        "summary": None if outcome is None else outcome.summary,
        "duration_s": None if st.started_at is None else round(st.last_t - st.started_at, 3),
        "nodes": {str(n): {"returncode": code, "log": run.node_log(n)} for n, code in st.node_exits.items()},
        "ranks": {
            # peak: the largest allocation peak its GPUs reported (bytes), None if it reported none
            str(r): {"pid": pid, "host": st.ranks[r].host if r in st.ranks else "", "log": run.rank_log(r),
                     "peak_gpu_memory": st.ranks[r].peak_memory if r in st.ranks and st.ranks[r].peak_memory else None}
            for r, pid in sorted(st.rank_pids.items())
        },
        "communicators": st.to_json(),
        "gpu_memory": st.memory_json(),
        "hangs": [
            {"kind": h.kind.value, "comm": h.comm, "comm_label": st.comm_label(h.comm) if h.kind is HangKind.COLLECTIVE else None, "seq": h.seq,
             "op": h.op.name, "joined": h.joined,
             "missing": h.missing, "waited_s": h.waited_s}
            for h in st.hangs
        ],
    }
    if topo.exec_mode.keeps_time or st.clocked:
        doc["clocked"] = {**st.clocked_json(), "profile": st.profile or topo.profile}
    return doc


def write(state: RunState, topology: Topology, outcome: Outcome | None, run: RunDir) -> None:
    """``report.json`` in the run directory (and at ``--report FILE``); a copy that cannot be written is named."""
    text = json.dumps(to_json(state, topology, outcome, run), indent=2)
    for path in [os.path.join(run.path, "report.json"), *([topology.report] if topology.report else [])]:
        try:
            with open(path, "w") as f:
                f.write(text + "\n")
        except OSError as e:  # the run is over; losing the copy must not lose the rest of the teardown
            print(f"mirage: could not write the report to {path}: {e}", file=sys.stderr)
