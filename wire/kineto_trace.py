"""Clocked mode's trace files: each rank's emulated GPU timeline as torch.profiler would export it (issue #16).

At exit every rank of a clocked run writes ``<run_dir>/traces/rank-<R>.json``
(:func:`write_rank_trace`): its kernels, collectives and copies, in emulated
time, in the Chrome Trace Event format that Kineto (torch.profiler's
``export_chrome_trace``) writes, close enough that Holistic Trace Analysis reads
the folder as the traces of a distributed job. When the run ends the session
merges them into ``<run_dir>/trace.json`` (:func:`merge_traces`), one file for
Perfetto with one process per rank and one track per stream.

What HTA (0.5) needs of a trace, and so what is written:

- ``distributedInfo.rank``, found by the regular expression ``"rank":\\s+(\\d+)``
  on the file's first lines: it must come first, written with json's default
  ``": "`` separator;
- ``traceEvents`` of ``ph: "X"`` with ``ts`` and ``dur`` in microseconds, ``cat``
  and ``name``; ``args.stream`` (an event without one is a CPU event to HTA) and
  ``args.correlation`` (>= 0 on a GPU event);
- kernel names that say what a kernel is: ``^nccl.*Kernel`` is communication,
  ``^Memcpy``/``^Memset`` memory, anything else computation;
- for its per-iteration analyses (temporal breakdown, stragglers, queue lengths):
  the host's side, ``ProfilerStep#N`` annotations and one ``cuda_runtime`` launch
  per GPU event (``hipLaunchKernel``, as a ROCm build's profiler names it) with
  the kernel's ``correlation``; a kernel belongs to the step its launch falls in.

This module imports neither torch nor the rest of mirage: the rank side calls it
at exit and the console at the end of a run.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

#: Where in a run directory the ranks' traces go, and the merged one.
TRACES_DIR = "traces"
MERGED_TRACE = "trace.json"

#: a rank's trace file in ``TRACES_DIR`` (written by :func:`write_rank_trace`)
RANK_TRACE = re.compile(r"rank-(\d+)\.json")

#: NCCL's kernel name for each collective (``ncclDevKernel_<Coll>_<ALGO>_<PROTO>``). RCCL names all of
#: its kernels ``ncclDevKernel_Generic``, which hides the op; both match HTA's ``^nccl.*Kernel``.
_COLL_KERNEL = {
    "all_reduce": "AllReduce", "allreduce": "AllReduce", "barrier": "AllReduce",  # a one-element all-reduce
    "all_gather": "AllGather", "allgather": "AllGather", "gather": "SendRecv", "scatter": "SendRecv",
    "reduce_scatter": "ReduceScatter", "broadcast": "Broadcast", "reduce": "Reduce",
    "all_to_all": "SendRecv", "alltoall": "SendRecv", "send": "SendRecv", "recv": "SendRecv",
}


def comm_kernel_name(name: str, args: dict | None) -> str:
    """The GPU kernel name of a collective ``name`` ("nccl:all_reduce"), as NCCL would name it."""
    op = (args or {}).get("op") or name.split(":", 1)[-1]
    coll = _COLL_KERNEL.get(op) or "".join(w.capitalize() for w in re.split(r"[_\W]+", op) if w) or "Generic"
    algo = str((args or {}).get("algo") or "")  # "ring/Simple"
    suffix = "".join("_" + part.upper() for part in algo.split("/") if part)
    return f"ncclDevKernel_{coll}{suffix}"


def _us(seconds: float) -> float:
    # Kineto's resolution: microseconds with three decimals. Rounding keeps 10 µs at 10.0, not
    # 10.000000000000002, which HTA (it rounds float times to whole µs, up for a start) would make 11.
    return round(seconds * 1e6, 3)


#: the host's call that launched each kind of GPU event, as a ROCm build's profiler (roctracer) names it
_LAUNCH = {"compute": "hipLaunchKernel", "comm": "hipLaunchKernel", "memcpy": "hipMemcpyAsync"}


def _kineto_event(event: tuple, correlation: int) -> dict | None:
    """One ``(kind, name, device, stream, start_s, end_s, args, issued_s)`` as a Kineto GPU event; None if
    unusable."""
    kind, name, device, stream, start_s, end_s, args, _ = event
    if not (math.isfinite(start_s) and math.isfinite(end_s)):
        return None
    ts = _us(start_s)
    dur = max(round(_us(end_s) - ts, 3), 0.0)
    kargs: dict = {"device": device, "stream": stream, "correlation": correlation}
    cat = "kernel"
    if kind == "comm":
        op = (args or {}).get("op") or name.split(":", 1)[-1]
        kargs["Collective name"] = op  # what torch.profiler's record_param_comms calls it
        if args and "group_size" in args:
            kargs["Group size"] = args["group_size"]
        name = comm_kernel_name(name, args)
    elif kind == "memcpy":
        cat = "gpu_memset" if name.startswith("Memset") else "gpu_memcpy"
    for key, value in (args or {}).items():
        kargs.setdefault(key, value)  # Kineto's own keys win: HTA reads them
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": ts, "dur": dur, "args": kargs}


def _host_events(launched: list[tuple[tuple, dict]], steps, pid: int) -> list[dict]:
    """The host thread's side of a rank's trace: ``ProfilerStep#N`` annotations, and for each
    ``(event, kernel)`` of ``launched`` (a clock event and the Kineto event made of it) the kernel's
    launch, at the time the host issued it."""
    host = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": pid, "tid": pid,
             "ts": _us(a), "dur": max(round(_us(b) - _us(a), 3), 0.0), "args": {}}
            for n, a, b in steps if math.isfinite(a) and math.isfinite(b)]
    for event, kernel in launched:
        issued = event[7]
        ts = min(_us(issued), kernel["ts"]) if math.isfinite(issued) else kernel["ts"]
        host.append({"ph": "X", "cat": "cuda_runtime", "name": _LAUNCH.get(event[0], "hipLaunchKernel"),
                     "pid": pid, "tid": pid, "ts": ts, "dur": 0.0,
                     "args": {"correlation": kernel["args"]["correlation"]}})
    return host


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    """A metadata event: Perfetto names and orders processes and tracks by these."""
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _write_atomically(path: str, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then move it over ``path``."""
    # ".tmp" last: HTA takes every *.json of a folder for a trace, a half-written one included
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_document(f, header: dict, events, footer: dict | None = None) -> None:
    """``header``, then ``traceEvents`` one event a line (streamed: a rank may have 500,000), then ``footer``."""
    f.write(json.dumps(header)[:-1] + (", " if header else "") + '"traceEvents": [\n')
    first = True
    for e in events:
        f.write(("" if first else ",\n") + json.dumps(e))
        first = False
    f.write("\n]")
    for key, value in (footer or {}).items():
        f.write(f",\n{json.dumps(key)}: {json.dumps(value)}")
    f.write("}\n")


def write_rank_trace(path: str, *, rank: int, world_size: int, profile: str, device_name: str,
                     events: list[tuple], steps=(), dropped: int = 0, device_properties: dict | None = None,
                     host_pid: int | None = None) -> None:
    """Write one rank's emulated timeline to ``path`` as a Kineto trace, atomically.

    ``events`` are ``(kind, name, device, stream, start_s, end_s, args, issued_s)``: ``kind`` "compute"
    (an aten op's kernel), "comm" (a collective, ``name`` "nccl:<op>") or "memcpy" ("Memcpy HtoD", ...);
    ``device`` the GPU index as the rank sees it, ``stream`` an int id, times in emulated seconds since
    the rank started (``issued_s``: when the host launched it), ``args`` None or a dict kept in the
    event's ``args``. ``steps`` are ``(n, start_s, end_s)``, written as ``ProfilerStep#n`` on the host
    thread (process and thread ``host_pid``, default this process's pid). ``dropped`` counts the
    events the rank did not keep; ``device_properties`` (optional) is added to each GPU's entry of
    ``deviceProperties``. Creates the folder; raises OSError if the file cannot be written.
    """
    host_pid = os.getpid() if host_pid is None else host_pid
    kineto: list[dict] = []
    launched: list[tuple[tuple, dict]] = []  # (event, its Kineto event): the host's launch of each
    streams: dict[tuple[int, int], bool] = {}  # (device, stream) -> whether it carries collectives
    unusable = 0
    for i, event in enumerate(events):
        e = _kineto_event(event, correlation=i + 1)
        if e is None:
            unusable += 1
            continue
        kineto.append(e)
        launched.append((event, e))
        key = (e["pid"], e["tid"])
        streams[key] = streams.get(key, False) or event[0] == "comm"
    devices = sorted({d for d, _ in streams})
    meta: list[dict] = []
    for d in devices:
        meta += [_meta("process_name", d, 0, {"name": f"GPU {d}"}),
                 _meta("process_labels", d, 0, {"labels": device_name}),
                 _meta("process_sort_index", d, 0, {"sort_index": d})]
    for (d, s), comm in sorted(streams.items()):
        meta += [_meta("thread_name", d, s, {"name": f"stream {s}" + (" (collectives)" if comm else "")}),
                 _meta("thread_sort_index", d, s, {"sort_index": s})]
    host = _host_events(launched, steps, host_pid)
    meta += [_meta("process_name", host_pid, 0, {"name": "host"}),
             _meta("thread_name", host_pid, host_pid, {"name": "host"})]
    header = {
        # first, and with json's default ": " separator: HTA finds the rank with '"rank":\s+(\d+)'
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size},
        "schemaVersion": 1,
        "deviceProperties": [{"id": d, "name": device_name, **(device_properties or {})} for d in devices],
        "displayTimeUnit": "ms",
        # the clock's zero, the rank's start: emulated time has no wall-clock epoch
        "baseTimeNanoseconds": 0,
        "traceName": os.path.basename(path),
        "mirage": {"exec_mode": "clocked", "time": "emulated, microseconds since the rank started",
                   "profile": profile, "device_name": device_name, "events": len(kineto),
                   "dropped_events": dropped + unusable},
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _write_atomically(path, lambda f: _write_document(f, header, [*meta, *host, *kineto]))


def _load_rank_trace(path: str) -> dict:
    """A rank's trace as written by :func:`write_rank_trace`; ValueError (or OSError) if it is not one."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)  # a truncated file: json.JSONDecodeError, a ValueError
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError("no traceEvents list")
    return data


def _order(key: tuple) -> tuple:
    # numbers in numeric order, anything else (a foreign file's string ids) after them
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in key)


def _merged_events(data: dict, rank: int):
    """One rank's events re-homed for the merged trace: one process for the rank, one thread per (GPU, stream)."""
    events = [e for e in data["traceEvents"] if isinstance(e, dict)]
    # Perfetto takes pid 0 for the kernel's idle task and keeps ids to 32 bits, and the clock's
    # collective streams count from 1 << 20: so here rank R is process R + 1 and its tracks are
    # threads 1, 2, ... in (GPU, stream) order. A track's name and each event's args say its stream.
    # The host's launches are left out (one per kernel, they would double the file for what the
    # kernels already show); its ProfilerStep annotations get a "host" track of their own.
    pid = rank + 1
    names: dict[tuple, str] = {}
    gpu_keys: set[tuple] = set()
    kernels = []
    for e in events:
        key = (e.get("pid", 0), e.get("tid", 0))
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if e.get("ph") == "M":
            if e.get("name") == "thread_name":
                names[key] = str(args.get("name", f"stream {key[1]}"))
        elif e.get("cat") != "cuda_runtime":
            kernels.append(e)
            names.setdefault(key, f"stream {key[1]}")
            if "stream" in args:
                gpu_keys.add(key)
    devices = sorted({d for d, _ in gpu_keys}, key=lambda d: _order((d,)))
    tracks = {key: i for i, key in enumerate(sorted(names, key=_order), start=1)}
    label = data["mirage"].get("device_name") if isinstance(data.get("mirage"), dict) else None
    gpus = ", ".join(str(d) for d in devices)
    yield _meta("process_name", pid, 0, {"name": f"rank {rank} (GPU {gpus})" if devices else f"rank {rank}"})
    yield _meta("process_sort_index", pid, 0, {"sort_index": rank})
    if label:
        yield _meta("process_labels", pid, 0, {"labels": label})
    for key, tid in tracks.items():
        name = names[key] if len(devices) < 2 else f"GPU {key[0]} {names[key]}"
        yield _meta("thread_name", pid, tid, {"name": name})
        yield _meta("thread_sort_index", pid, tid, {"sort_index": tid})
    for e in kernels:
        yield dict(e, pid=pid, tid=tracks[(e.get("pid", 0), e.get("tid", 0))])


def rank_traces(folder: str) -> list[tuple[int, str]]:
    """The rank traces (``rank-R.json``) in ``folder`` as ``(R, file name)``, in rank order; [] if none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted((int(m.group(1)), n) for n in names if (m := RANK_TRACE.fullmatch(n)))


def merge_traces(run_dir: str) -> str | None:
    """Merge a run's ``traces/rank-*.json`` into ``<run_dir>/trace.json`` for Perfetto; return its path.

    One process per rank ("rank R (GPU d)", pid R + 1), one thread per stream, times as the ranks wrote them
    (every rank's clock starts at 0 and collectives keep them in step). A rank file that cannot be
    read (truncated, malformed) is left out and named under ``mirage.skipped``. Returns None when
    the run has no rank traces, or when the merged file cannot be written (said on stderr).
    """
    folder = os.path.join(run_dir, TRACES_DIR)
    files = rank_traces(folder)
    if not files:
        return None
    info: dict = {"exec_mode": "clocked", "time": "emulated, microseconds since each rank started",
                  "ranks": [], "dropped_events": {}, "skipped": []}

    def events():
        for rank, name in files:
            path = os.path.join(folder, name)
            try:
                data = _load_rank_trace(path)
            except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                info["skipped"].append({"file": path, "reason": f"{type(e).__name__}: {e}"[:300]})
                continue
            info["ranks"].append(rank)
            mirage = data.get("mirage") if isinstance(data.get("mirage"), dict) else {}
            if mirage.get("dropped_events"):
                info["dropped_events"][str(rank)] = mirage["dropped_events"]
            if "profile" in mirage:
                info.setdefault("profile", mirage["profile"])
            yield from _merged_events(data, rank)

    out = os.path.join(run_dir, MERGED_TRACE)
    try:
        # the footer is written after the events, so it holds what reading them found
        _write_atomically(out, lambda f: _write_document(f, {"displayTimeUnit": "ms"}, events(), {"mirage": info}))
    except OSError as e:
        print(f"mirage: could not write the trace to {out}: {e}", file=sys.stderr)
        return None
    return out
