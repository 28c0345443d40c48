"""Clocked mode's rank side: every stream of every emulated GPU keeps emulated time (issue #16).

With ``MIRAGE_EXEC_MODE=clocked`` (``mirage run --exec-mode clocked``) the
process has one :class:`Clock`, ``RUNTIME.clock`` (``shim.rank.runtime``).
Kernels still run on the CPU at once, for the right answers; the clock says
when each *would* have run on the profile's GPU:

- each aten op on an emulated tensor is a kernel on the thread's current
  stream, lasting what :func:`shim.clock.roofline.op_cost` says, starting when that
  stream is free, when the host issued it, and when any collective that wrote
  one of its inputs had finished (the data dependency a stream wait guarantees
  on hardware);
- a host/device copy is a memcpy over the host link; a device-to-host copy and
  ``.item()`` make the host wait for it, as they synchronise on a GPU;
- a collective runs on its communicator's own stream (ProcessGroupNCCL has one
  per group and device): ready when the issuing stream and the communicator's
  previous collective are; the daemon starts it when every member is ready and
  answers its start and end (``emulator/collective_clock.py``). ``Work.wait()``
  makes the current stream wait for it;
- ``torch.cuda`` streams and events follow (``shim/cuda/api.py``): ``record``,
  ``wait_event``, ``wait_stream``, ``synchronize``, ``elapsed_time``.

The host itself is modeled as infinitely fast: it only waits where it
synchronises. Each ``optimizer.step()`` (over GPU parameters) ends a step: the step's emulated time,
compute, communication and exposed (not overlapped) communication go to the
daemon as a :class:`~wire.schema.StepReport`. At exit the rank writes its
kernels and collectives as a Kineto-style trace (``traces/rank-<R>.json`` in
the run directory). Functional mode has no clock: ``RUNTIME.clock`` is None and the
dispatch pays one test of it per op.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from types import MappingProxyType

import torch

from shim.clock.op_costs import OpCosts
from shim.clock.roofline import OpCost, is_free, kernel_cost
from shim.device.storages import storage_key
from shim.rank.runtime import RUNTIME
from wire.profiles import Profile
from wire.schema import StepReport

#: Kernels and collectives kept for the trace, per rank; past it the step figures still count them.
MAX_TRACE_EVENTS = 500_000
#: Host <-> device copies: PCIe 5.0 x16 (64 GB/s each way, what the MI300X and MI350X OAM
#: modules attach with) at the ~80 % that large pinned copies reach. An assumption, not fitted.
HOST_LINK_BYTES_PER_S = 64e9 * 0.8
#: Stream ids of the communicators' streams start here (user streams count up from 1).
COMM_STREAM_BASE = 1 << 20

#: how a collective's kernel is named in the trace, as ProcessGroupNCCL names its profiler events
_COLL_NAMES = MappingProxyType({
    "allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
    "send": "send", "recv": "recv"})

_aten = torch.ops.aten
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
# by id: OpOverload.__hash__ is a Python method, and charge() asks of every op
_SCALAR_READS = frozenset(id(op) for op in (_aten._local_scalar_dense.default, _aten.equal.default,
                                              _aten.is_nonzero.default))


def _first_gpu(args) -> int | None:
    """The GPU of the first emulated tensor among ``args`` (or in a list or tuple of tensors among them)."""
    for a in args:
        # (a tensor first: getattr on an int would make and drop an AttributeError)
        if isinstance(a, torch.Tensor):
            g = getattr(a, "_gpu", None)
            if g is not None:
                return g
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            for x in a:  # a _foreach_ op's tensors (Adam's update): one kernel over them all, as on a GPU
                g = getattr(x, "_gpu", None)
                if g is not None:
                    return g
    return None


def _emulated(args):
    """The emulated tensors among ``args`` and in their lists and tuples of tensors."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if hasattr(a, "_gpu"):
                yield a
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            yield from (x for x in a if hasattr(x, "_gpu"))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _uncovered(these: list[tuple[float, float]], by: list[tuple[float, float]]) -> float:
    """Length of the union of ``these`` not covered by the union of ``by`` (both already unions)."""
    left, j = 0.0, 0
    for a, b in these:
        t = a
        while j < len(by) and by[j][1] <= t:
            j += 1
        k = j
        while t < b and k < len(by) and by[k][0] < b:
            if by[k][0] > t:
                left += by[k][0] - t
            t = max(t, by[k][1])
            k += 1
        if t < b:
            left += b - t
    return left



class Clock:
    """The emulated clocks of one rank process: its streams, its host, its steps, its trace."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.costs = OpCosts(profile)  # the ops priced in Python, by signature
        self.lock = threading.Lock()
        self.streams: dict[tuple[int, int], float] = {}  # (gpu, stream id) -> when its last kernel ends
        self.host = 0.0  # when the host may issue its next kernel (it waits only where it synchronises)
        self.ready_at: dict[int, float] = {}  # storage address -> when the collective writing it ends
        self.ready_max = 0.0  # the latest of ready_at's times
        self.comm_streams: dict[str, int] = {}  # communicator id -> the stream id its collectives run on
        # the thread's current stream id on a GPU; shim.cuda.api installs the real one
        self.stream_of = lambda gpu: 0
        # the trace: (kind, name, gpu, stream, start, end, args, issued), issued = when the host launched it
        self.events: list[tuple] = []
        self.dropped = 0
        self.steps: list[tuple[int, float, float]] = []  # (step, start, end) of every step ended
        self.names: dict[int, str] = {}
        self.rank: int | None = None
        # the step in progress
        self.step = 0
        self.step_start = 0.0
        self.compute: list[tuple[float, float]] = []
        self.comm: list[tuple[float, float]] = []
        self.ops = 0
        self.bytes_only_ops = 0

    # ------------------------------------------------------------ kernels

    def _record(self, event: tuple) -> None:
        if len(self.events) < MAX_TRACE_EVENTS:
            self.events.append(event)
        else:
            self.dropped += 1

    def _issued(self, start: float) -> float:
        """When the host launched a kernel that starts at ``start``, as the trace tells it.

        The host is infinitely fast: it issues everything at its last synchronisation. In the trace
        it keeps the step's pace, as a training loop's host does: no launch before the step it belongs
        to began, none after the kernel started."""
        return min(start, max(self.host, self.step_start))

    def _name(self, func) -> str:
        name = self.names.get(id(func))
        if name is None:
            name = self.names[id(func)] = f"{func.namespace}::{func._opname}"
        return name

    def charge(self, func, args, kwargs, out) -> None:
        """Advance the current stream by the kernel ``func(*args, **kwargs) -> out`` (a dispatched aten op)."""
        if is_free(func):  # a view (autograd's detach, ...): no kernel, nothing to price
            return
        # torch's function modes off while it reads the tensors' metadata: the shim's CudaMode would run
        # Python for every stride(), storage and size asked for (most of what pricing an op cost)
        with _NO_TORCH_FUNCTION():
            gpu = _first_gpu(args)
            if gpu is None:
                gpu = getattr(out, "_gpu", None) if isinstance(out, torch.Tensor) else None
                if gpu is None:
                    return
            stream = self.stream_of(gpu)
            deps = self._written_at(_emulated(args), gpu, stream)
            if id(func) in _SCALAR_READS:  # .item() and friends: a few bytes to the host, which waits
                self._copy(func, gpu, 8, deps, to_host=True)
                return
            if isinstance(out, torch.Tensor) and not hasattr(out, "_gpu") and out.device.type == "cpu":
                self._copy(func, gpu, out.numel() * out.element_size(), deps, to_host=True)
                return
            self._advance(gpu, stream, func, self.costs.cost(func, args, kwargs, out), deps)

    def charge_priced(self, gpu: int, func, cost: OpCost, inputs: tuple) -> None:
        """As :meth:`charge`, for an op on ``gpu`` already priced (the C++ fast dispatch's table of costs,
        shim/native/fast_dispatch.cpp): ``inputs`` are its emulated arguments, which a collective may
        still be writing."""
        stream = self.stream_of(gpu)
        self._advance(gpu, stream, func, cost, self._written_at(inputs, gpu, stream))

    def _advance(self, gpu: int, stream: int, func, cost: OpCost, deps: float) -> None:
        """Run the kernel ``func`` priced ``cost`` on ``stream`` of ``gpu``, from ``deps`` at the earliest."""
        seconds = cost.seconds
        if not seconds:
            return
        name = self.names.get(id(func)) or self._name(func)
        # (_record and _issued written out: this runs for every op clocked mode times)
        with self.lock:
            key = (gpu, stream)
            host = self.host
            start = max(self.streams.get(key, 0.0), host, deps)
            end = self.streams[key] = start + seconds
            self.compute.append((start, end))
            self.ops += 1
            if not cost.has_formula:
                self.bytes_only_ops += 1
            if len(self.events) < MAX_TRACE_EVENTS:
                issued = min(start, max(host, self.step_start))
                self.events.append(("compute", name, gpu, stream, start, end, cost.trace_args, issued))
            else:
                self.dropped += 1

    def fused(self, gpu: int, kernels: list) -> None:
        """A compiled graph's kernels, one after another on the current stream of ``gpu``.

        ``kernels``: ``(name, flops or None, bytes, dtype or None, attention or None)`` of each kernel the
        compiler generated (shim/clock/compiled.py), each timed as one kernel (:func:`shim.clock.roofline.kernel_cost`).
        """
        with self.lock:
            key = (gpu, self.stream_of(gpu))
            start = max(self.streams.get(key, 0.0), self.host)
            for name, flops, nbytes, dtype, attn in kernels:
                start = self._run(key, name, start, kernel_cost(flops, nbytes, dtype, self.profile, attn))
            self.streams[key] = start

    def kernel(self, gpu: int, name: str, cost: OpCost, tensors) -> None:
        """One kernel priced by its caller (a Triton launch: shim/clock/triton_kernels.py) on the current
        stream of ``gpu``; it starts once the collectives that wrote any of ``tensors`` have ended."""
        deps = self._written_at(tensors)
        with self.lock:
            key = (gpu, self.stream_of(gpu))
            self.streams[key] = self._run(key, name, max(self.streams.get(key, 0.0), self.host, deps), cost)

    def _run(self, key: tuple[int, int], name: str, start: float, cost: OpCost) -> float:
        """Record the kernel ``name`` on the stream ``key`` from ``start`` (lock held); when it ends."""
        end = start + cost.seconds
        self.compute.append((start, end))
        self.ops += 1
        if not cost.has_formula:
            self.bytes_only_ops += 1
        self._record(("compute", name, key[0], key[1], start, end, cost.trace_args, self._issued(start)))
        return end

    def _written_at(self, tensors, gpu: int | None = None, stream: int | None = None) -> float:
        """When the last collective that wrote one of the emulated ``tensors`` ends (0: none did, or none
        ends after the kernel could start anyway: after ``stream`` of ``gpu`` and the host, where given)."""
        deps = 0.0
        floor = self.host if gpu is None else max(self.streams.get((gpu, stream), 0.0), self.host)
        if self.ready_max <= floor:  # (most ops: looking up each tensor's storage costs more than the op's price)
            return deps
        with _NO_TORCH_FUNCTION():  # (the shim's CudaMode would run Python for each storage asked for)
            for t in tensors:
                try:
                    deps = max(deps, self.ready_at.get(storage_key(t._elem), 0.0))
                except RuntimeError:  # a storage torch invalidated: no collective wrote it
                    continue
        return deps

    def copy_to_device(self, gpu: int, nbytes: int) -> None:
        """A host-to-device copy onto ``gpu`` (``.to("cuda")``, ``.cuda()``) on its current stream."""
        self._copy(None, gpu, nbytes, 0.0, to_host=False)

    def _copy(self, func, gpu: int, nbytes: int, deps: float, to_host: bool) -> None:
        with self.lock:
            key = (gpu, self.stream_of(gpu))
            start = max(self.streams.get(key, 0.0), self.host, deps)
            end = self.streams[key] = start + nbytes / HOST_LINK_BYTES_PER_S
            issued = self._issued(start)
            if to_host:
                self.host = end  # the copy (or .item()) returns once the device got there
            self._record(("memcpy", "Memcpy DtoH" if to_host else "Memcpy HtoD", gpu, key[1], start, end,
                          {"bytes": nbytes}, issued))

    # ------------------------------------------------------------ collectives

    def comm_stream(self, comm_id: str) -> int:
        sid = self.comm_streams.get(comm_id)
        if sid is None:
            sid = self.comm_streams[comm_id] = COMM_STREAM_BASE + len(self.comm_streams)
        return sid

    def collective_ready(self, gpu: int, comm_id: str) -> float:
        """When a collective issued now on ``gpu`` may start: its stream is where the issuing stream is,
        and after the communicator's previous collective."""
        with self.lock:
            return max(self.streams.get((gpu, self.stream_of(gpu)), 0.0), self.host,
                       self.streams.get((gpu, self.comm_stream(comm_id)), 0.0))

    def collective_done(self, gpu: int, comm_id: str, name: str, start: float, end: float, args: dict,
                        outputs) -> None:
        """A collective ran from ``start`` to ``end`` (the daemon's answer); ``outputs`` are ready then."""
        with self.lock:
            key = (gpu, self.comm_stream(comm_id))
            self.streams[key] = max(self.streams.get(key, 0.0), end)
            self.comm.append((start, end))
            self._record(("comm", name, gpu, key[1], start, end, args, self._issued(start)))
            for t in outputs or ():
                t = getattr(t, "_elem", t)  # an emulated tensor's data
                if t is not None and t.numel():
                    self.ready_at[storage_key(t)] = end
                    self.ready_max = max(self.ready_max, end)
            if len(self.ready_at) > 4096:  # outputs nobody read before every stream went past them
                done = min(self.streams.values())
                self.ready_at = {p: t for p, t in self.ready_at.items() if t > done}
                self.ready_max = max(self.ready_at.values(), default=0.0)
        if self.rank is None:
            self.rank = _global_rank()

    def wait_until(self, gpu: int, t: float) -> None:
        """The current stream of ``gpu`` waits for emulated time ``t`` (a collective's end, an event)."""
        with self.lock:
            key = (gpu, self.stream_of(gpu))
            if t > self.streams.get(key, 0.0):
                self.streams[key] = t

    # ------------------------------------------------------------ streams and events

    def stream_time(self, gpu: int, stream_id: int) -> float:
        """When the last kernel queued on that stream ends (as an event recorded there now would fire)."""
        return max(self.streams.get((gpu, stream_id), 0.0), self.host)

    def stream_wait(self, gpu: int, stream_id: int, t: float) -> None:
        with self.lock:
            key = (gpu, stream_id)
            if t > self.streams.get(key, 0.0):
                self.streams[key] = t

    def host_wait(self, t: float) -> None:
        """The host blocks until emulated time ``t`` (``synchronize()``)."""
        with self.lock:
            if t > self.host:
                self.host = t

    def device_time(self, gpu: int | None = None) -> float:
        """When every stream (of ``gpu``, or of every GPU) is done."""
        return max((t for (g, _), t in self.streams.items() if gpu is None or g == gpu), default=0.0)

    # ------------------------------------------------------------ steps

    def end_step(self) -> None:
        """``optimizer.step()`` returned: the step ends when the GPU has done its work; report it.

        A step in which nothing ran and no time passed is no step: an optimizer that steps others inside its own
        ``step()`` (torchtitan's ``OptimizersContainer``, a ``torch.optim.Optimizer`` itself) returns right after
        the inner one ended the step, and would end a second, empty one, halving the predicted step."""
        with self.lock:
            end = max(self.device_time(), self.host)
            if self.ops == 0 and not self.compute and not self.comm and end <= self.step_start:
                return
            compute, comm = _union(self.compute), _union(self.comm)
            self.step += 1
            report = dict(step=self.step, t_start=self.step_start, t_end=end, compute_s=_length(compute),
                          comm_s=_length(comm), exposed_comm_s=_uncovered(comm, compute), ops=self.ops,
                          bytes_only_ops=self.bytes_only_ops)
            self.steps.append((self.step, self.step_start, end))
            self.step_start = end
            self.compute, self.comm = [], []
            self.ops = self.bytes_only_ops = 0
        _send_step(report)


def collective_name(op) -> str:
    """``nccl:all_reduce`` and so on, for a :class:`~wire.schema.CollOp`."""
    return "nccl:" + _COLL_NAMES.get(op.value, op.value)


def _global_rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def _send_step(report: dict) -> None:
    """Tell the daemon (unanswered); a rank without one (a test, in process) keeps its figures."""
    if not RUNTIME.settings.has_daemon:
        return
    rank = _global_rank()
    try:
        client = RUNTIME.client()
        msg = StepReport(rank=rank or 0, node=RUNTIME.settings.node_rank, **report)
        # with the rank-to-rank collectives' books, a datagram every few steps rather than two a step
        # (sending it would flush theirs first); the daemon has it within DEFER_MAX_S, or when the rank blocks
        if client.has_fast:
            client.defer(msg, reply=False)
        else:
            client.send(msg, reply=False)
    except Exception:  # noqa: BLE001 - the daemon is gone: the run is ending and says why elsewhere
        pass


def _step_hook(optimizer, args, kwargs) -> None:
    # an optimizer of CPU parameters only (a reference model, weights averaged on the host) ends no GPU step
    clock = RUNTIME.clock
    if clock is not None and any(p.device.type == "cuda" for g in optimizer.param_groups for p in g["params"]):
        clock.end_step()


def write_trace() -> str | None:
    """Write this rank's trace into the run directory (``traces/rank-<R>.json``); its path, or None."""
    run_dir, clock = RUNTIME.settings.run_dir, RUNTIME.clock
    if clock is None or not run_dir or not clock.events:
        return None
    from wire import kineto_trace

    rank = clock.rank if clock.rank is not None else _global_rank()
    rank = 0 if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    path = os.path.join(run_dir, "traces", f"rank-{rank}.json")
    try:
        kineto_trace.write_rank_trace(path, rank=rank, world_size=world, profile=clock.profile.name,
                                      device_name=clock.profile.product, events=clock.events, steps=clock.steps,
                                      dropped=clock.dropped)
    except OSError as e:
        print(f"mirage: could not write the clocked trace {path}: {e}", file=sys.stderr, flush=True)
        return None
    return path


def install(profile: Profile) -> None:
    """Start keeping emulated time (``MIRAGE_EXEC_MODE=clocked``): the runtime's clock (None in functional
    mode); called once by the shim's activation."""
    if not RUNTIME.settings.clocked or RUNTIME.clock is not None:
        return
    RUNTIME.clock = Clock(profile)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_step_hook)
    atexit.register(write_trace)
