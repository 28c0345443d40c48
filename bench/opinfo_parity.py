"""Fidelity against PyTorch's own corpus: every OpInfo sample on CPU and on emulated cuda, compared.

    python bench/opinfo_parity.py [--ops abs,matmul,...] [--limit N] [--dtypes float32,bfloat16,int64]
                                  [--no-backward] [--autocast fp16|bf16] [--json out.json]

Walks ``torch.testing._internal.common_methods_invocations.op_db``. The
comparison runs where a user's program would: inside ``mirage run
--in-process -- python bench/opinfo_parity.py --worker ...`` (the shim is
active there; this process only drives it). For each op and dtype the worker
builds the op's sample inputs on ``cuda``, copies them to the CPU with
``.cpu()``, runs the op on both, and compares every output; then, for ops with
autograd, the gradients of every input for a fixed random cotangent; then the
in-place variant and the ``out=`` variant. Each comparison is one of:

- identical: bit for bit (NaNs in the same places), same dtype and shape, and
  every tensor output reports a ``cuda`` device;
- within tolerance: ``torch.testing.assert_close`` at its default tolerances;
- shape only: random ops (the CPU reference gives other values for another
  seed) are compared by shape and dtype, and must be reproducible on cuda for
  one seed; ops with uninitialised outputs (``empty*``) by shape and dtype alone;
- failed: anything else, including an exception on one side only (when both
  sides raise, the exception types must match).

With ``--autocast fp16|bf16`` every call runs under ``torch.autocast`` in
that dtype: on cuda the shim's autocast (shim/device/autocast.py), and on the CPU a
reference that applies CUDA's policy by hand — the worker replaces CPU
autocast's kernels with its own (:func:`use_cuda_policy_on_cpu`: CUDA's op
lists, casts written here independently of the shim, every other op left
alone), so both sides must cast the same tensors to the same dtypes. Under
autocast an op may raise for every sample on both sides (a float16 input a
CPU and a GPU kernel both lack, ``binary_cross_entropy``'s refusal): when it
runs without autocast, the same error on both sides is a match, not a broken
op.

An op's result is its worst sample's. Each op runs under a time limit in the
worker, and a worker that crashes or hangs is replaced, the op in progress
counted as failed, so one op cannot stop the run. docs/fidelity.md has the
figures and the remaining failures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Seconds one op (all its samples, forward and backward) may take inside the worker (most take
#: well under one).
OP_TIMEOUT_S = 30
#: Seconds without a result after which the driver replaces a worker: past the in-worker limit,
#: for a worker stuck where SIGALRM cannot reach (in C, or a deadlock in a finaliser).
HANG_S = OP_TIMEOUT_S + 15
#: Statuses, best to worst; an op takes its worst sample's.
RANK = {"identical": 0, "within_tol": 1, "shape_only": 2, "failed": 3}
#: What is compared per op: the function variant, its gradients, the in-place variant, out=.
PHASES = ("forward", "backward", "inplace", "out")
#: ``--autocast`` choices: the dtype autocast lowers to
AUTOCAST = {"fp16": "float16", "bf16": "bfloat16"}


# ---------------------------------------------------------------- the driver (no shim here)


def run(ops: list[str] | None = None, limit: int | None = None, dtypes: tuple[str, ...] = ("float32",),
        backward: bool = True, log_dir: str | None = None, autocast: str | None = None) -> list[dict]:
    """Run the comparison in ``mirage run --in-process`` workers and return one row per (op, dtype).

    A worker that dies or stops making progress is replaced; the item it was on
    is reported as failed with the reason.
    """
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = log_dir or os.path.join(tmp, "runs")
        plan: list[list[str]] | None = None
        todo_args = ["--dtypes", ",".join(dtypes)] + (["--no-backward"] if not backward else [])
        mode_args = ["--autocast", autocast] if autocast else []
        todo_args += mode_args
        if ops:
            todo_args += ["--ops", ",".join(ops)]
        if limit:
            todo_args += ["--limit", str(limit)]
        while True:
            results = os.path.join(tmp, f"results-{len(rows)}.jsonl")
            args = list(todo_args)
            if plan is not None:
                remaining = plan[len(rows):]
                if not remaining:
                    break
                items = os.path.join(tmp, "items.json")
                with open(items, "w") as f:
                    json.dump(remaining, f)
                args = ["--items", items] + (["--no-backward"] if not backward else []) + mode_args
            new_plan, new_rows, started, reason = _one_worker(args, results, logs)
            if plan is None:
                plan = new_plan or []
            rows.extend(new_rows)
            if reason is None:
                break
            if started is None:  # the worker died before its first op: nothing to skip past
                raise SystemExit(f"opinfo_parity: worker failed to start: {reason}")
            rows.append({"op": started[0], "dtype": started[1], "samples": 0, "seconds": 0.0,
                         "forward": "failed", "forward_error": reason, "backward": None, "backward_error": None})
    return rows


def _one_worker(args: list[str], results: str, logs: str):
    """One worker process; returns (plan, rows, item it was on when it stopped early, why it stopped)."""
    cmd = [sys.executable, "-m", "mirage_tui", "run", "--in-process", "--log-dir", logs, "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", "--results", results, *args]
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    plan, rows, started, last_change, seen = None, [], None, time.monotonic(), 0
    output: list[str] = []
    reader = _Tail(proc, output)
    reason = None
    while True:
        lines = _read_new(results, seen)
        if lines:
            seen += len(lines)
            last_change = time.monotonic()
        for line in lines:
            rec = json.loads(line)
            if "plan" in rec:
                plan = rec["plan"]
            elif "start" in rec:
                started = rec["start"]
            else:
                rows.append(rec)
                started = None
        if proc.poll() is not None and not _read_new(results, seen):
            break
        if started is not None and time.monotonic() - last_change > HANG_S:
            proc.terminate()  # mirage run stops its node process and everything under it
            proc.wait(timeout=60)
            reason = f"hung: no result after {HANG_S} s (worker killed)"
            break
        time.sleep(0.2)
    reader.join()
    if reason is None and (started is not None or plan is None):
        tail = "".join(output[-15:]).strip().replace("\n", " | ")
        reason = f"worker exited {proc.returncode} mid-op: {tail[-400:]}"
    return plan, rows, started, reason


class _Tail:
    """Drains a child's output on a thread (so it never blocks on a full pipe), keeping it for errors."""

    def __init__(self, proc: subprocess.Popen, into: list[str]):
        self._t = threading.Thread(target=lambda: into.extend(proc.stdout), daemon=True)
        self._t.start()

    def join(self) -> None:
        self._t.join(timeout=10)


def _read_new(path: str, seen: int) -> list[str]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    # the part after the last newline is a line still being written
    return text.split("\n")[:-1][seen:]


def summarize(rows: list[dict]) -> dict:
    """Counts per dtype and pass (forward, backward): attempted, each status, and the parity percentage."""
    out: dict = {}
    for row in rows:
        for phase in PHASES:
            status = row.get(phase)
            if status is None or status == "skipped":
                continue
            c = out.setdefault(row["dtype"], {}).setdefault(
                phase, {"attempted": 0, "identical": 0, "within_tol": 0, "shape_only": 0, "failed": 0})
            c["attempted"] += 1
            c[status] += 1
    for phases in out.values():
        for c in phases.values():
            matched = c["attempted"] - c["failed"]
            c["parity_pct"] = round(100.0 * matched / c["attempted"], 1) if c["attempted"] else 0.0
    return out


def print_table(rows: list[dict], summary: dict) -> None:
    """The figures per dtype and pass, then every failure with its first error."""
    print(f"{'dtype':>9} {'pass':>8} {'attempted':>9} {'identical':>9} {'within tol':>10} "
          f"{'shape only':>10} {'failed':>6} {'parity':>7}")
    for dtype, phases in summary.items():
        for phase, c in phases.items():
            print(f"{dtype:>9} {phase:>8} {c['attempted']:>9} {c['identical']:>9} {c['within_tol']:>10} "
                  f"{c['shape_only']:>10} {c['failed']:>6} {c['parity_pct']:>6.1f}%")
    skipped = [r for r in rows if r["forward"] == "skipped"]
    if skipped:
        print(f"\nnot compared ({len(skipped)}): "
              + ", ".join(f"{r['op']} [{r['dtype']}] ({r['forward_error']})" for r in skipped))
    failures = [(r, p) for r in rows for p in PHASES if r.get(p) == "failed"]
    if failures:
        print(f"\nfailures ({len(failures)}), first error per op:")
        for r, p in failures:
            err = (r[f"{p}_error"] or "").replace("\n", " ")
            print(f"  {r['op']} [{r['dtype']}] {p}: {err[:300]}")


def main() -> None:
    """Command line: the driver by default, the worker with ``--worker`` (inside mirage run)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", help="comma-separated OpInfo names (op.full_name, e.g. div.floor_rounding)")
    ap.add_argument("--limit", type=int, help="only the first N ops of op_db (after --ops)")
    ap.add_argument("--dtypes", default="float32",
                    help="dtypes to run, comma-separated (default float32; an op without float32 on cuda "
                         "runs in its first supported dtype instead)")
    ap.add_argument("--no-backward", action="store_true", help="compare forward results only")
    ap.add_argument("--autocast", choices=sorted(AUTOCAST),
                    help="run every call under torch.autocast in this dtype (the CPU side follows CUDA's policy)")
    ap.add_argument("--json", help="write the rows and the summary here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    ap.add_argument("--items", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker(ns)
        return
    started = time.monotonic()
    rows = run(ns.ops.split(",") if ns.ops else None, ns.limit, tuple(ns.dtypes.split(",")), not ns.no_backward,
               autocast=ns.autocast)
    summary = summarize(rows)
    print_table(rows, summary)
    mode = f" under autocast {ns.autocast}" if ns.autocast else ""
    print(f"\n{len(rows)} (op, dtype) items{mode} in {time.monotonic() - started:.0f} s")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"command": sys.argv, "summary": summary, "rows": rows}, f, indent=1)


# ---------------------------------------------------------------- the worker (inside mirage run)


class Mismatch(Exception):
    """The cuda result differs from the CPU reference."""


def worker(ns) -> None:
    """Compare the planned (op, dtype) items, appending one JSON line per item to ``ns.results``."""
    import warnings

    import torch

    if not torch.cuda.is_available() or "shim.activate" not in sys.modules:
        raise SystemExit("opinfo_parity --worker must run inside mirage run (the shim is not active)")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the machine is shared; both sides run the same CPU kernels anyway
    from torch.testing._internal.common_methods_invocations import op_db

    if ns.autocast:
        global _AUTOCAST_DTYPE
        _AUTOCAST_DTYPE = getattr(torch, AUTOCAST[ns.autocast])
        use_cuda_policy_on_cpu()
    by_name = {op.full_name: op for op in op_db}
    if ns.items:
        with open(ns.items) as f:
            plan = json.load(f)
    else:
        plan = _plan(op_db, ns.ops.split(",") if ns.ops else None, ns.limit, ns.dtypes.split(","))
    out = open(ns.results, "a", buffering=1)
    out.write(json.dumps({"plan": plan}) + "\n")
    signal.signal(signal.SIGALRM, _on_alarm)
    for name, dtype_name in plan:
        out.write(json.dumps({"start": [name, dtype_name]}) + "\n")
        start = time.monotonic()
        signal.alarm(OP_TIMEOUT_S)
        try:
            row = compare_op(by_name[name], getattr(torch, dtype_name), backward=not ns.no_backward)
        except _Timeout:
            row = {"samples": 0, "forward": "failed", "forward_error": f"timed out after {OP_TIMEOUT_S} s"}
        except Exception as e:  # noqa: BLE001 - e.g. copying a sample to the CPU failed: the op's finding
            row = {"samples": 0, "forward": "failed", "forward_error": f"comparison raised {_err(e)}"}
        finally:
            signal.alarm(0)
        row = {"op": name, "dtype": dtype_name, **row, "seconds": round(time.monotonic() - start, 3)}
        out.write(json.dumps(row) + "\n")
    out.close()


class _Timeout(BaseException):
    """Raised in the worker by SIGALRM; a BaseException so an op's own ``except Exception`` cannot swallow it."""


def _on_alarm(signum, frame):
    raise _Timeout()


#: The dtype an op without float32 on cuda runs in: the first of these it supports.
_FALLBACK = ("int64", "int32", "bool", "uint8", "complex64", "float64", "bfloat16", "float16")


def _plan(op_db, names: list[str] | None, limit: int | None, dtypes: list[str]) -> list[list[str]]:
    """The (op, dtype) items to run: each op in each requested dtype it supports on cuda."""
    import torch

    ops = op_db
    if names:
        known = {op.full_name for op in op_db}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"unknown ops: {', '.join(unknown)}")
        ops = [op for op in op_db if op.full_name in names]
    if limit:
        ops = ops[:limit]
    plan = []
    for op in ops:
        supported = op.supported_dtypes("cuda")
        chosen = [d for d in dtypes if getattr(torch, d) in supported]
        if not chosen and "float32" in dtypes and supported:
            # ops with no float32 on cuda (bitwise, gcd, histogram...) run in their most common dtype
            fallback = [d for d in _FALLBACK if getattr(torch, d) in supported]
            chosen = fallback[:1] or [str(sorted(supported, key=str)[0]).removeprefix("torch.")]
        plan += [[op.full_name, d] for d in chosen]
    return plan


def compare_op(op, dtype, backward: bool = True) -> dict:
    """Run every sample of ``op`` in ``dtype`` on cuda and on the CPU; the worst sample decides.

    Returns ``samples`` and a status and first error for each pass: ``forward``
    (the function variant), ``backward`` (None when the op has no autograd for
    the dtype), ``inplace`` (the in-place method, e.g. ``add_``, on a clone of
    the input) and ``out`` (``out=`` tensors allocated on cuda); a variant the
    op lacks is None.
    """
    import torch

    res = {"samples": 0, "forward": "identical", "forward_error": None, "backward": None, "backward_error": None,
           "inplace": None, "inplace_error": None, "out": None, "out_error": None}
    try:
        torch.manual_seed(0)
        samples = list(op.sample_inputs("cuda", dtype, requires_grad=False))
    except Exception as e:  # noqa: BLE001 - building inputs on cuda is part of what is measured
        return dict(res, forward="failed", forward_error=f"sample_inputs on cuda: {_err(e)}")
    if not samples:
        return dict(res, forward="skipped", forward_error="no samples")
    res["samples"] = len(samples)
    random_samples = set()
    cpu_errors = []
    no_reference = 0
    for i, s in enumerate(samples):
        try:
            status, random, ref_err = _compare_forward(op, s, nondeterministic=op.has_nondeterministic_output)
            if ref_err is not None:
                cpu_errors.append(ref_err)
        except _NoReference:
            no_reference += 1
            continue
        except Mismatch as e:
            status, random = "failed", False
            res["forward_error"] = res["forward_error"] or f"sample {i}: {e}"
        if random or op.has_nondeterministic_output:  # the variants compare these by shape only too
            random_samples.add(i)
        if RANK[status] > RANK[res["forward"]]:
            res["forward"] = status
    if no_reference == len(samples):
        return dict(res, forward="skipped", forward_error="GPU-only op: no CPU kernel to compare against")
    if len(cpu_errors) == len(samples) - no_reference and not _autocast_made_it_raise(op, samples):
        # op_db's samples are valid inputs: an op that raises for all of them in this process
        # (on both sides) is broken by the emulation, e.g. a torch.cuda function it calls
        return dict(res, forward="failed", forward_error=f"raises for every sample, on CPU too: {_err(cpu_errors[0])}")
    if backward and op.supports_autograd and dtype in op.supported_backward_dtypes("cuda"):
        res["backward"] = _compare_backward(op, dtype, random_samples, res)
    if op.inplace_variant is not None:
        res["inplace"] = _compare_variant(op, samples, random_samples, res, "inplace", _run_inplace)
    if op.supports_out:
        res["out"] = _compare_variant(op, samples, random_samples, res, "out", _run_out)
    return res


def _autocast_made_it_raise(op, samples) -> bool:
    """Under ``--autocast``, whether the op's first sample runs on the CPU without autocast (so autocast's
    casts are what make it raise, on both sides: a float16 input no kernel takes, a refused op)."""
    global _AUTOCAST_DTYPE
    if _AUTOCAST_DTYPE is None:
        return False
    dtype, _AUTOCAST_DTYPE = _AUTOCAST_DTYPE, None
    try:
        return _call(op, to_cpu(samples[0]), seed=1)[1] is None
    finally:
        _AUTOCAST_DTYPE = dtype


def _compare_variant(op, samples, random_samples: set[int], res: dict, name: str, run_one) -> str | None:
    """The worst status of ``run_one`` over the samples it applies to (None if it applies to none)."""
    status = None
    for i, s in enumerate(samples):
        try:
            cpu_s = to_cpu(s)
            ref, ref_err = run_one(op, cpu_s, None)
            if ref is None and ref_err is None:
                continue  # the variant does not apply to this sample
            got, got_err = run_one(op, s, ref)
            if ref_err or got_err:
                _same_error(ref_err, got_err)
                st = "identical"
            else:
                st = compare(ref, got, values=i not in random_samples, on_cuda=names_cuda(s))
                st = "shape_only" if i in random_samples else st
        except Exception as e:  # noqa: BLE001 - any failure of the cuda side is a finding
            st = "failed"
            res[f"{name}_error"] = res[f"{name}_error"] or f"sample {i}: {_err(e)}"
        if status is None or RANK[st] > RANK[status]:
            status = st
    return status


def _run_inplace(op, sample, ref):
    """The in-place variant on a clone of the input: (its result and the input after), or (None, error)."""
    import torch

    if sample.broadcasts_input or not isinstance(sample.input, torch.Tensor):
        return None, None  # in-place cannot broadcast its self argument
    inp = sample.input.detach().clone()
    torch.manual_seed(1)
    try:
        return (op.inplace_variant(inp, *sample.args, **sample.kwargs), inp), None
    except Exception as e:  # noqa: BLE001
        return None, e


def _run_out(op, sample, ref):
    """The op with ``out=`` tensors shaped like the CPU result (on the sample's device): (result, outs)."""
    import torch
    from torch.utils._pytree import tree_flatten

    if ref is None:  # the CPU side: find the result's structure first
        plain, err = _call(op, sample, seed=1)
        if err is not None or not all(isinstance(t, torch.Tensor) for t in tree_flatten(plain)[0]):
            return None, None  # no reference, or outputs out= cannot express
        shapes = plain
    else:
        shapes = ref[1]
    device = "cuda" if names_cuda(sample) else "cpu"
    outs = tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in tree_flatten(shapes)[0])
    out = outs[0] if isinstance(shapes, torch.Tensor) else outs
    torch.manual_seed(1)
    try:
        return (op(sample.input, *sample.args, **sample.kwargs, out=out), out), None
    except Exception as e:  # noqa: BLE001
        return None, e


def _compare_forward(op, sample, nondeterministic: bool) -> tuple[str, bool, Exception | None]:
    """(status, whether the op is random, the CPU reference's exception) for one sample; raises Mismatch."""
    cpu_sample = to_cpu(sample)
    on_cuda = names_cuda(sample)
    ref, ref_err = _call(op, cpu_sample, seed=1)
    if isinstance(ref_err, NotImplementedError) and "from the 'CPU' backend" in str(ref_err):
        raise _NoReference()
    got, got_err = _call(op, sample, seed=1)
    if ref_err or got_err:
        _same_error(ref_err, got_err)
        return "identical", False, ref_err
    if nondeterministic:
        compare(ref, got, values=False, on_cuda=on_cuda)
        return "shape_only", False, None
    try:
        return compare(ref, got, on_cuda=on_cuda), False, None
    except Mismatch:
        # a random op gives other values for another seed; its cuda results must still repeat for one seed
        again, _ = _call(op, cpu_sample, seed=2)
        if _equal(ref, again):
            raise
        compare(ref, got, values=False, on_cuda=on_cuda)
        repeat, err = _call(op, sample, seed=1)
        if err is not None or not _equal(_cpu(got), _cpu(repeat)):
            raise Mismatch("random op is not reproducible on cuda for one seed") from None
        return "shape_only", True, None


def _compare_backward(op, dtype, random_samples: set[int], res: dict) -> str:
    """Gradients of every input that requires grad, for a fixed cotangent; the worst sample's status."""
    import torch

    status = "identical"
    try:
        torch.manual_seed(0)
        samples = list(op.sample_inputs("cuda", dtype, requires_grad=True))
    except Exception as e:  # noqa: BLE001
        res["backward_error"] = f"sample_inputs(requires_grad=True) on cuda: {_err(e)}"
        return "failed"
    compared = 0
    for i, s in enumerate(samples):
        try:
            ref = _grads(op, to_cpu(s), on_cuda=False)
            if ref is None:
                continue
            got = _grads(op, s, on_cuda=True)
            if got is None:
                raise Mismatch("cuda outputs do not require grad where the CPU outputs do")
            compared += 1
            st = compare(ref, got, values=i not in random_samples, on_cuda=True)
            st = "shape_only" if i in random_samples else st
        except _CpuRaised:
            continue
        except Exception as e:  # noqa: BLE001 - any failure of the cuda side is a finding
            st = "failed"
            res["backward_error"] = res["backward_error"] or f"sample {i}: {_err(e)}"
        if RANK[st] > RANK[status]:
            status = st
    return status if compared or status == "failed" else "skipped"


class _NoReference(Exception):
    """The op has no CPU kernel (flash attention...): the sample has no reference to compare with."""


class _CpuRaised(Exception):
    """The CPU reference itself cannot differentiate this sample: nothing to compare."""


def _grads(op, sample, on_cuda: bool):
    """The gradients of ``sample``'s inputs for cotangents drawn from a fixed CPU generator, or None."""
    import torch
    from torch.utils._pytree import tree_flatten

    try:
        out, err = _call(op, sample, seed=1)
        if err is not None:
            raise err
        out = sample.output_process_fn_grad(out)
    except Exception as e:
        if on_cuda:
            raise
        raise _CpuRaised() from e
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not inputs:
        return None
    gen = torch.Generator().manual_seed(3)
    cot = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in outs]
    if on_cuda:
        cot = [c.to("cuda") for c in cot]
    try:
        return torch.autograd.grad(outs, inputs, cot, allow_unused=True)
    except Exception as e:
        if on_cuda:
            raise
        raise _CpuRaised() from e


def _call(op, sample, seed: int):
    """``op(sample)`` under ``seed`` (and autocast, with ``--autocast``): (result, None) or (None, the exception)."""
    import contextlib

    import torch

    torch.manual_seed(seed)
    autocast = contextlib.nullcontext()
    if _AUTOCAST_DTYPE is not None:
        autocast = torch.autocast("cuda" if names_cuda(sample) else "cpu", dtype=_AUTOCAST_DTYPE)
    try:
        with autocast:
            return op(sample.input, *sample.args, **sample.kwargs), None
    except Exception as e:  # noqa: BLE001
        return None, e


#: the worker's ``--autocast`` dtype (None: no autocast)
_AUTOCAST_DTYPE = None
_reference_libs: list = []


def use_cuda_policy_on_cpu() -> None:
    """Make ``torch.autocast("cpu")`` apply CUDA's autocast policy: the reference for ``--autocast``.

    CPU autocast has lists of its own; each op it casts is made to fall through,
    then CUDA's ops (the lists in shim/device/autocast.py, which tests/test_fidelity.py
    checks against the AutocastCUDA kernels torch registers) get kernels written
    here from ATen's policies (autocast_mode.h): arguments bound by name to the
    schema, eligible (floating, not float64) tensors cast.
    """
    import warnings

    import torch

    from shim.device import autocast as cuda_policy

    key = torch._C.DispatchKey.AutocastCPU
    exclude = torch._C.DispatchKeySet(key)
    lib = torch.library.Library("aten", "IMPL")
    _reference_libs.append(lib)

    def eligible(t):
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def cast(x, dtype):
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v, dtype) for v in x)
        return x.to(dtype) if eligible(x) and x.dtype != dtype else x

    def bind(op, args, kwargs):
        names = [a.name for a in op._schema.arguments]
        return {**dict(zip(names, args)), **kwargs}

    def kernel(op, policy):
        def run(*args, **kwargs):
            bound = bind(op, args, kwargs)
            first = next(iter(bound.values()))
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if policy == "lower":
                    dtype = torch.get_autocast_dtype("cpu")
                    return op(**{k: cast(v, dtype) for k, v in bound.items()})
                if policy == "fp32":
                    return op(**{k: cast(v, torch.float32) for k, v in bound.items()})
                if policy == "set_opt_dtype":
                    if eligible(first) and bound.get("dtype") is None:
                        bound["dtype"] = torch.float32
                    return op(**bound)
                # promote: float32 wins over the autocast dtype, float64 and non-floating tensors are ignored
                dtype = torch.get_autocast_dtype("cpu")
                for t in torch.utils._pytree.tree_leaves(list(bound.values())):
                    if eligible(t) and t.dtype == torch.float32:
                        dtype = torch.float32
                return op(**{k: cast(v, dtype) for k, v in bound.items()})
        return run

    def norm(to_overload):
        def run(self, p=2, dim=None, keepdim=False):
            dtype = torch.float32 if eligible(self) else self.dtype
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if dim is None:
                    return to_overload(self, p, dtype=dtype)
                return to_overload(self, p, dim, keepdim, dtype=dtype)
        return run

    def banned(*args, **kwargs):
        raise RuntimeError("unsafe to autocast")  # CUDA refuses binary_cross_entropy (the type is compared)

    def overload(name):
        packet, _, over = name.partition(".")
        return getattr(getattr(torch.ops.aten, packet), over or "default")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        policies = ((cuda_policy.LOWER_PRECISION_FP, "lower"), (cuda_policy.FP32, "fp32"),
                    (cuda_policy.FP32_SET_OPT_DTYPE, "set_opt_dtype"), (cuda_policy.PROMOTE, "promote"))
        cuda_ops = {n for names, _ in policies for n in names} | {n for n, _, _ in cuda_policy.APPEND_DTYPE}
        cuda_ops |= set(cuda_policy.BANNED)
        for name in torch._C._dispatch_get_all_op_names():
            short = name.removeprefix("aten::")
            if (name.startswith("aten::") and short not in cuda_ops
                    and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")):
                lib.impl(short, torch.library.fallthrough_kernel, "AutocastCPU")
        for names, policy in policies:
            for name in names:
                lib.impl(name, kernel(overload(name), policy), "AutocastCPU")
        for name, to_overload, _ in cuda_policy.APPEND_DTYPE:
            lib.impl(name, norm(overload(to_overload)), "AutocastCPU")
        for name in cuda_policy.BANNED:
            lib.impl(name, banned, "AutocastCPU")


def _same_error(ref_err, got_err) -> None:
    if ref_err is None:
        raise Mismatch(f"cuda raised, CPU did not: {_err(got_err)}")
    if got_err is None:
        raise Mismatch(f"CPU raised, cuda did not: {_err(ref_err)}")
    if type(ref_err) is not type(got_err):
        raise Mismatch(f"CPU raised {_err(ref_err)}; cuda raised {_err(got_err)}")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def to_cpu(sample):
    """The sample with every tensor copied to the CPU (``.cpu()``, through the shim) and cuda devices named cpu.

    A view is copied with its base and viewed again, so that ops that address
    the storage (``as_strided`` with a ``storage_offset``) see the same memory.
    """
    import torch
    from torch.utils._pytree import tree_map

    def copy(x):
        base = x._base
        if base is not None and base.dtype == x.dtype and base.layout == x.layout == torch.strided:
            b = base.detach().cpu()
            if b.stride() == base.stride():
                return b.as_strided(x.size(), x.stride(), x.storage_offset())
        return x.detach().cpu()

    def one(x):
        if isinstance(x, torch.Tensor):
            c = copy(x)
            return c.requires_grad_(x.requires_grad) if x.requires_grad else c
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        if isinstance(x, str) and (x == "cuda" or x.startswith("cuda:")):
            return "cpu"
        return x

    return type(sample)(
        tree_map(one, sample.input), args=tree_map(one, sample.args), kwargs=tree_map(one, sample.kwargs),
        output_process_fn_grad=sample.output_process_fn_grad, broadcasts_input=sample.broadcasts_input,
        name=sample.name)


def _cpu(x):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, x)


def _equal(a, b) -> bool:
    try:
        return compare(a, b, on_cuda=False) == "identical"
    except Mismatch:
        return False


def names_cuda(sample) -> bool:
    """Whether a sample has a cuda tensor or names a cuda device: then a GPU build returns cuda tensors."""
    import torch
    from torch.utils._pytree import tree_flatten

    for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]:
        if isinstance(x, torch.Tensor):
            x = x.device
        if isinstance(x, torch.device) and x.type == "cuda" or isinstance(x, str) and x.startswith("cuda"):
            return True
    return False


def compare(ref, got, values: bool = True, on_cuda: bool = True) -> str:
    """``identical`` or ``within_tol`` for a CPU reference and a result of the emulation; raises Mismatch.

    With ``on_cuda``, tensors of ``got`` must report a cuda device where
    ``ref``'s are on the CPU (else the same device as ``ref``'s); with
    ``values=False`` only structure, devices, dtypes and shapes are compared.
    """
    import math

    import torch
    from torch.utils._pytree import tree_flatten

    ref_leaves, ref_spec = tree_flatten(ref)
    got_leaves, got_spec = tree_flatten(got)
    if len(ref_leaves) != len(got_leaves):
        raise Mismatch(f"output structure differs: {ref_spec} vs {got_spec}")
    status = "identical"
    for k, (r, g) in enumerate(zip(ref_leaves, got_leaves)):
        if isinstance(r, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise Mismatch(f"output {k}: CPU gave a tensor, cuda gave {type(g).__name__}")
            expected = "cuda" if on_cuda and r.device.type == "cpu" else r.device.type
            if g.device.type != expected:
                raise Mismatch(f"output {k}: on {g.device}, expected {expected}")
            if r.dtype != g.dtype or r.shape != g.shape:
                raise Mismatch(f"output {k}: {g.dtype}{list(g.shape)} vs CPU {r.dtype}{list(r.shape)}")
            if r.layout != g.layout:
                raise Mismatch(f"output {k}: layout {g.layout} vs CPU {r.layout}")
            if not values:
                continue
            g = g.detach().cpu()
            r = r.detach()
            if r.layout != torch.strided:
                r, g = r.to_dense(), g.to_dense()
            try:
                torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True, check_device=False,
                                           check_stride=False)
            except AssertionError:
                try:
                    torch.testing.assert_close(g, r, equal_nan=True, check_device=False, check_stride=False)
                except AssertionError as e:
                    msg = " ".join(str(e).split())
                    raise Mismatch(f"output {k}: {msg[:240]}") from None
                status = "within_tol"
        elif isinstance(g, torch.Tensor):
            raise Mismatch(f"output {k}: CPU gave {type(r).__name__}, cuda gave a tensor")
        elif values and r != g and not (isinstance(r, float) and isinstance(g, float) and math.isnan(r)
                                        and math.isnan(g)):
            raise Mismatch(f"output {k}: {g!r} vs CPU {r!r}")
    return status


if __name__ == "__main__":
    main()
