"""The ``"nccl"`` process group: every collective goes to the daemon's books, most through its data path.

``init_process_group("nccl")`` is routed here (the CPU build refuses the real
NCCL) while ``dist.get_backend()`` still answers ``"nccl"``. A collective
copies each input into shared memory (the rank's arena, or a buffer of its own
while others are in flight), posts it to the daemon with the next sequence
number of its communicator and returns; its ``Work`` waits for ``Done`` and
copies the result back, the rank's collectives in the order it posted them, as
on one stream. The daemon reduces in place, over shared memory. A large tensor
all-reduced or broadcast again is not copied at all: its storage is lent to the
daemon, which works in it (``shim/shared_buffers.py``).

A communicator whose transport is NET/Socket (members on different emulated
nodes, or ``NCCL_P2P_DISABLE=1`` and ``NCCL_SHM_DISABLE=1``) sends the input
bytes as ZeroMQ data frames after the request instead, and its ``Work`` takes
the output from the frame that comes back after ``Done``.

A small all-reduce, broadcast or barrier on shared memory goes rank to rank
instead (``shim/direct.py``): the ranks exchange the data through their own
rings, and the daemon, told afterwards, only keeps the books.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.futures import Future

from emulator import faults, kernels
from emulator.arena import Arena, arena_name
from emulator import schema as s
from shim import client as cl
from shim import shared_buffers as sb
from shim import direct, nccl_debug, pinned, pinned_build
from shim import device as dev
from shim.cuda import NCCL_VERSION
from shim.tensor import MirageTensor

NAME = "mirage"
NAME_WITH_GLOO = "mirage_gloo"
IN_PROCESS_MESSAGE = (
    "--in-process gives each process its own emulator; multi-process collectives need the daemon "
    "— drop --in-process"
)
_NCCL_TEXT = {
    "ncclInvalidUsage": ("invalid usage", "This usually reflects invalid usage of NCCL library."),
    "ncclInvalidArgument": ("invalid argument", "Invalid value for an argument."),
    "ncclSystemError": ("unhandled system error", "System call (e.g. socket, malloc) or external library call failed."),
    "ncclRemoteError": ("remote process exited or there was a network error", "A call failed possibly due to a network error or a remote process exiting prematurely."),
}
_REDUCE = {
    dist.ReduceOp.RedOpType.SUM: s.ReduceOp.SUM,
    dist.ReduceOp.RedOpType.AVG: s.ReduceOp.AVG,
    dist.ReduceOp.RedOpType.PRODUCT: s.ReduceOp.PRODUCT,
    dist.ReduceOp.RedOpType.MIN: s.ReduceOp.MIN,
    dist.ReduceOp.RedOpType.MAX: s.ReduceOp.MAX,
}


#: ``_reduction``'s answer for each plain reduction, made once (callers only unpack it)
_KEYWORDS = {red: {"reduce_op": op} for red, op in _REDUCE.items()}


def _reduction(opts) -> dict:
    """``_run``'s keywords for the options' reduction (C++ hands us a ReduceOp wrapping a RedOpType).

    ``premul_sum`` (``dist._make_nccl_premul_sum(factor)``) is NCCL's sum of
    inputs each scaled by ``factor``: the scaling happens here, on the staged
    copy, and the daemon sums.
    """
    if opts is None:
        return _KEYWORDS[dist.ReduceOp.RedOpType.SUM]
    red = opts.reduceOp
    kw = _KEYWORDS.get(red.op)  # one lookup for the plain reductions (a third of the time it took)
    if kw is not None:
        return kw
    if red.op == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = red.factor
        return {"reduce_op": s.ReduceOp.SUM, "premul": factor.item() if isinstance(factor, torch.Tensor) else factor}
    op = _REDUCE.get(red.op)
    if op is None:
        raise ValueError(f"reduce op {red.op.name} is not supported by the emulated NCCL")
    return {"reduce_op": op}


def _nccl_error(code: str, message: str, device: int) -> dist.DistBackendError:
    """An exception worded as ProcessGroupNCCL words it (users grep for these)."""
    short, explain = _NCCL_TEXT.get(code, ("internal error", "Internal check failed."))
    print(
        f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} [{device}] "
        f"NCCL WARN {message}",
        file=sys.stderr,
        flush=True,
    )
    return dist.DistBackendError(
        f"NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2210, {short} "
        f"(run with NCCL_DEBUG=WARN for details), NCCL version {'.'.join(map(str, NCCL_VERSION))}\n"
        f"{code}: {explain}\nLast error:\n{message}"
    )


#: Frames in these folders are the machinery, not the user's code.
_INTERNAL_DIRS = (os.path.join(os.path.dirname(torch.__file__), ""), os.path.join(os.path.dirname(__file__), ""))


#: code object -> whether it is torch's or mirage's; (code object, line) -> its call site text.
#: The walk (a dozen frames up from ``_run``) matched each frame's file against the folders on
#: every collective; now each code object is asked once. Still walked per call: the site is
#: where this call came from (hang reports name it), and one code object has many lines.
_INTERNAL_CODE: dict = {}
_SITES: dict = {}


def _call_site() -> str:
    """file:line:function of the first frame outside torch and mirage."""
    f = sys._getframe(2)
    internal = _INTERNAL_CODE
    while f is not None:
        code = f.f_code
        inside = internal.get(code)
        if inside is None:
            if len(internal) > 4096:  # code made on the fly (exec, eval) must not pile up
                internal.clear()
            inside = internal[code] = code.co_filename.startswith(_INTERNAL_DIRS)
        if not inside:
            key = (code, f.f_lineno)
            site = _SITES.get(key)
            if site is None:
                if len(_SITES) > 4096:
                    _SITES.clear()
                site = _SITES[key] = f"{code.co_filename}:{key[1]}:{code.co_name}"
            return site
        f = f.f_back
    return ""


#: Set while a functional collective (``torch.ops._c10d_functional``: DTensor, clip_grad_norm_ on
#: DTensors) runs on the host data of emulated tensors: the GPU those CPU tensors belong to.
_host = threading.local()


def functional_collective(func, args, kwargs, gpu: int):
    """Run functional collective ``func`` on the CPU data (``args``) of GPU ``gpu``'s tensors.

    ``MirageTensor.__torch_dispatch__`` unwraps every op's arguments; for these
    ops the unwrapped tensors reach this group, which takes them as ``gpu``'s.
    """
    _host.gpu = gpu
    try:
        return func(*args, **kwargs)
    finally:
        _host.gpu = None


def _host_gpu() -> int | None:
    return getattr(_host, "gpu", None)


def _gpu(t: torch.Tensor) -> int:
    """The emulated GPU of a collective's tensor."""
    return t._gpu if isinstance(t, MirageTensor) else _host.gpu


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The CPU data of a collective's tensor, refused as ProcessGroupNCCL refuses it."""
    if isinstance(t, MirageTensor):
        t = t._elem
    elif _host_gpu() is None or t.device.type != "cpu":
        raise ValueError(f"Tensors must be CUDA and dense; got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError("Tensors must be contiguous")
    return t


def _any_emulated(args) -> bool:
    """Whether any argument of a collective, its lists opened (two levels: lists of lists of tensors),
    is an emulated GPU's tensor; stops at the first (usually the first argument's first tensor)."""
    for a in args:
        if isinstance(a, MirageTensor):
            return True
        if isinstance(a, list):
            for b in a:
                if isinstance(b, MirageTensor) or (
                    isinstance(b, list) and any(isinstance(c, MirageTensor) for c in b)
                ):
                    return True
    return False


def _cpu_via_gloo(method):
    """Send a collective of CPU tensors to the group's gloo half, or refuse it as ProcessGroupNCCL does."""

    @functools.wraps(method)
    def route(self, *args, **kwargs):
        if _any_emulated(args) or _host_gpu() is not None:
            return method(self, *args, **kwargs)
        if self._cpu is None:
            raise RuntimeError("No backend type associated with device type cpu")
        return getattr(self._cpu, method.__name__)(*args, **kwargs)

    return route


def _into(dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A ``deliver`` that copies a collective's flat output into ``dst``."""

    def deliver(flat: torch.Tensor) -> None:
        dst.copy_(flat.view(dst.shape))

    deliver.targets = [dst]  # what a later collective must not read before this one is delivered
    return deliver


def _into_each(dsts: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """A ``deliver`` that splits a collective's flat output over ``dsts``, in order."""

    def deliver(flat: torch.Tensor) -> None:
        at = 0
        for d in dsts:
            d.copy_(flat[at : at + d.numel()].view(d.shape))
            at += d.numel()

    deliver.targets = dsts
    return deliver


#: --inject faults of the whole run, and those of this process: chosen by the default group's rank
#: when it is created (not $RANK: mp.spawn children all inherit their parent's); they count its seqs.
_PLANNED = faults.parse_env(os.environ.get(faults.ENV, ""))
_FAULTS: list[faults.Fault] = []
_faults_chosen = False


def _inject(seq: int) -> bool:
    """Act out a fault planned for collective ``seq``; True when the collective is to be skipped."""
    for f in list(_FAULTS):
        if f.seq != seq:
            continue
        _FAULTS.remove(f)  # once: a skipped collective's number comes round again
        print(f"mirage: injecting {f.action.value} at collective #{seq} of rank {f.rank}", file=sys.stderr, flush=True)
        if f.action is faults.Action.DELAY:
            time.sleep(f.delay_s)
        elif f.action is faults.Action.HANG:
            while True:
                time.sleep(3600)
        elif f.action is faults.Action.CRASH:
            os.abort()
        else:
            return True
    return False


#: Posting and completing collectives, from any thread of the process.
_COLLECTIVE_LOCK = threading.Lock()
#: Entered with the lock: staging and delivering only touch plain CPU tensors (a collective's
#: unwrapped data, arena views), so the global ``CudaMode`` has nothing to do there, and passing
#: its ``__torch_function__`` on each of their dozen torch calls was a fifth of a small
#: all-reduce's time in the rank.
_PLAIN = torch._C.DisableTorchFunction


# -- what torch.profiler sees of a collective, as ProcessGroupNCCL records it (``shim/comms_native.cpp``):
# "record_param_comms" around posting, with the collective's metadata, and an async "nccl:<op>"
# event with the call's inputs from posting until its work completes.
#: the library (it also registers DDP's timer for the emulated device), or None: see NATIVE_ERROR
_native: ctypes.CDLL | None = None
#: None once loaded; else why not (one line): then no profiler events, and DDP reports no times
NATIVE_ERROR: str | None = "shim.backend.install() has not run"
_profiler_enabled = torch._C._autograd._profiler_enabled
#: c10's ScalarType numbering, which ParamCommsDebugInfo records as the collective's dtype
_SCALAR_TYPE = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.complex32: 8, torch.complex64: 9, torch.complex128: 10,
    torch.bool: 11, torch.bfloat16: 15,
}
_Handle = ctypes.c_void_p
#: global ranks of the group being created, set around ``_new_process_group_helper`` (the backend's
#: constructor is not told them); what NCCL derives its globalRankStart / globalRankStride from
_creating_ranks: list[int] = []


def _load_native() -> None:
    global _native, NATIVE_ERROR
    try:
        lib = pinned_build.load(pinned_build.COMMS_SOURCE, "the collectives' profiler events and DDP's timer")
    except pinned_build.BuildError as e:
        NATIVE_ERROR = str(e)
        return
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.mirage_work_begin.restype = _Handle
    lib.mirage_work_begin.argtypes = [ctypes.c_char_p, i64p, ctypes.c_int]
    lib.mirage_work_end.argtypes = [_Handle]
    lib.mirage_param_comms_begin.restype = _Handle
    lib.mirage_param_comms_begin.argtypes = [
        ctypes.c_int64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int, i64p, ctypes.c_int, i64p, ctypes.c_int, i64p, ctypes.c_int, i64p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]
    lib.mirage_param_comms_end.argtypes = [_Handle]
    _native, NATIVE_ERROR = lib, None


def _tensors_of(x) -> list[torch.Tensor]:
    """The tensors of a collective's argument (a tensor, a list, a list of lists), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors_of(item)]
    return []


def _impls(tensors: list[torch.Tensor]):
    # NCCL records a complex tensor as the real view it sends
    ts = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
    return (ctypes.c_int64 * len(ts))(*(t._cdata for t in ts)), ts  # the views must live through the call


def _ints(values):
    values = list(values or [])
    return (ctypes.c_int64 * len(values))(*values), len(values)


def _profiled(title: str, coll: str, inputs: int, outputs: int | None = None):
    """Record a collective method's calls for torch.profiler as ProcessGroupNCCL does (when one listens).

    ``title`` is the async event's name (``{rank}``/``{peer}`` filled in for
    point-to-point), ``coll`` record_param_comms' collective name, ``inputs`` and
    ``outputs`` the argument positions of the input and output tensors.
    """

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if _native is None or not _profiler_enabled():
                return method(self, *args, **kwargs)
            ins = _tensors_of(args[inputs]) if inputs < len(args) else []
            outs = _tensors_of(args[outputs]) if outputs is not None and outputs < len(args) else ins
            peer = args[1] if title.endswith("}") and len(args) > 1 else None
            name = title.format(rank=self._rank, peer=peer)
            in_arr, _in_keep = _impls(ins)
            out_arr, _out_keep = _impls(outs)
            in_splits = out_splits = None
            if method.__name__ == "alltoall_base":
                out_splits, in_splits = args[2], args[3]
            in_s, n_in_s = _ints(in_splits)
            out_s, n_out_s = _ints(out_splits)
            start, stride = self._global_start_stride
            pc = _native.mirage_param_comms_begin(
                self._seq + 1, self._group_name.encode(), self._group_desc.encode(), self._rank, coll.encode(),
                sum(t.numel() for t in ins), sum(t.numel() for t in outs),
                _SCALAR_TYPE.get(ins[0].dtype if ins else torch.float32, 6), in_arr, len(ins), out_arr, len(outs),
                in_s, n_in_s, out_s, n_out_s, start, stride, self._size,
            )
            handle = _native.mirage_work_begin(name.encode(), in_arr, len(ins))
            try:
                work = method(self, *args, **kwargs)
            except BaseException:
                if handle:
                    _native.mirage_work_end(handle)
                raise
            finally:
                if pc:
                    _native.mirage_param_comms_end(pc)
            if handle:
                work._profile = handle  # closed when the work completes
            return work

        return call

    return wrap


def _record_wait(pg, last) -> None:
    """The "record_param_comms" event named "wait" that ProcessGroupNCCL's ``WorkNCCL::wait`` records."""
    empty, _ = _ints([])
    name, desc = (pg._group_name, pg._group_desc) if pg is not None else ("", "")
    handle = _native.mirage_param_comms_begin(
        last.request.seq if last is not None else -1, name.encode(), desc.encode(),
        pg._rank if pg is not None else -1, b"wait", 0, 0, 0, empty, 0, empty, 0, empty, 0, empty, 0, -1, -1, 1)
    if handle:
        _native.mirage_param_comms_end(handle)


def _end_profile(work) -> None:
    """Close a completed work's profiler event, once."""
    handle, work._profile = work._profile, None
    if handle:
        _native.mirage_work_end(handle)


class _Pending:
    """A collective posted to the daemon whose output is not delivered yet."""

    def __init__(self, pg, request: s.Collective, req: int, slot: int | None, staged, out_view,
                 deliver, device: int, posted_at: float):
        self.pg, self.request, self.req, self.slot = pg, request, req, slot  # slot None: socket transport
        self.staged, self.out_view, self.deliver, self.device = staged, out_view, deliver, device
        self.posted_at = posted_at
        self.targets = getattr(deliver, "targets", [])
        self.done = False
        self.ring = 0  # rank to rank (``shim.direct``): its index in the communicator's rings

    def ready(self) -> bool:
        """Whether completing it would not block: the daemon answered, or (rank to rank) every peer posted."""
        if self.ring and self.pg._rings.arrived(self.ring):
            return True
        return self.pg._client.poll(self.req)


#: Posted collectives of this process, oldest first. They complete strictly in this order, as
#: kernels on one stream do: a later collective's output never lands before an earlier one's.
_PENDING: deque[_Pending] = deque()
#: Staging buffers for collectives in flight together. Slot 0 is the client's arena (used
#: when nothing else is in flight, i.e. always for synchronous calls); slots 1.. are grown on
#: demand, named ``...-s<slot>-g<generation>`` so that the daemon drops a slot's old mapping.
_SLOTS: dict[int, Arena] = {}
_SLOT_GENERATION = itertools.count(1)
_busy_slots: set[int] = set()


def _slot_arena(client: cl.DaemonClient, slot: int, nbytes: int) -> Arena:
    if slot == 0:
        return client.arena(nbytes)
    arena = _SLOTS.get(slot)
    if arena is None or arena.size < nbytes:
        if arena is not None:
            arena.close()
            arena.unlink()
        tag = f"{client.tag}-s{slot}-g{next(_SLOT_GENERATION)}"
        arena = _SLOTS[slot] = Arena.create(arena_name(client.session, tag), max(nbytes, 1 << 20))
    return arena


def _drain(group_name: str | None = None) -> None:
    """Complete posted collectives, in order, as ``ncclCommFinalize`` does before a communicator lets go:
    those of the group named ``group_name`` (and, the order being a stream's, every earlier one), or all.

    Each waits at most its group's timeout; a failure raises as the collective's own wait would.
    """
    with _COLLECTIVE_LOCK, _PLAIN():
        last = next((p for p in reversed(_PENDING) if group_name is None or p.pg._group_name == group_name), None)
        if last is not None:
            _complete_through(last)


@atexit.register
def _unlink_slots() -> None:
    """At exit: complete what the process posted and never waited for, then remove its staging buffers.

    A peer's collective reads this rank's inputs from these buffers (and from
    the storages it lent, and its rings) when the peer posts it, maybe after
    this process is gone. A process ending on an uncaught exception does not
    wait (NCCL aborts its communicators then); its peers' collectives fail.
    """
    if _PENDING and not hasattr(sys, "last_value"):
        try:
            _drain()
        except Exception as e:  # noqa: BLE001 - the exit goes on; the collective's error is the news
            print(f"mirage: at exit, a collective posted and never waited for failed: {str(e).splitlines()[0]}",
                  file=sys.stderr, flush=True)
        if cl._client is not None:
            cl._client.flush()  # the books of rank-to-rank collectives completed just now
    for arena in _SLOTS.values():
        arena.unlink()


def _payload(inputs: list[torch.Tensor], premul: float | None) -> memoryview | None:
    """The bytes a socket-transport collective sends: its inputs in order (one input as it is, not copied)."""
    if not sum(t.numel() for t in inputs):
        return None
    if len(inputs) == 1 and premul is None:
        flat = inputs[0].detach().reshape(-1)
    else:
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        if premul is not None:
            flat.mul_(premul)
    return memoryview(flat.view(torch.uint8).numpy())


def _received(data: memoryview | None, numel: int, dtype: str) -> torch.Tensor:
    """A socket-transport output as a flat tensor over the frame the daemon sent back (checked against its size)."""
    dt = getattr(torch, dtype)
    got = 0 if data is None else len(data)
    if got != numel * dt.itemsize:
        raise dist.DistBackendError(
            f"mirage: the daemon sent {got} bytes for an output of {numel} x {dtype} ({numel * dt.itemsize} bytes)"
        )
    return torch.frombuffer(data, dtype=dt) if numel else torch.empty(0, dtype=dt)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _complete_through(last: _Pending) -> None:
    """Deliver every posted collective up to and including ``last``, in order (lock held)."""
    while not last.done:
        _complete(_PENDING[0])


def _complete(p: _Pending) -> None:
    """Wait for the daemon's answer to ``p`` and copy its output out (lock held; ``p`` is the oldest)."""
    pg = p.pg
    try:
        if p.ring:
            return pg._finish_direct(p)
        reply = pg._reply(p)
        if isinstance(reply, s.Done) and reply.devices and nccl_debug.enabled():
            nccl_debug.print_init(pg._comm, pg._rank, reply.devices, reply.hosts)
        if p.slot is None:
            data = pg._client.data(p.req)  # taken even when nothing is delivered: it goes with the reply
            if p.deliver is not None:
                p.deliver(p.staged if p.staged is not None else _received(data, p.request.out_numel, p.request.dtype))
        elif p.deliver is not None:
            p.deliver(p.staged if p.out_view is None else p.out_view)
    finally:
        _PENDING.popleft()
        _busy_slots.discard(p.slot)
        p.done = True
        p.staged = p.out_view = p.deliver = p.targets = None


class _CollectiveWork(dist.Work):
    """The ``Work`` of a collective call: done once every collective it posted has been delivered.

    ``get_future()`` completes the work first and hands back a completed future,
    so ``then()`` callbacks run at once in the caller's thread — as ``CUDAFuture``
    runs them — and a hook's nested collectives keep the same order on every rank.
    """

    _profile = None  # the profiler's open event for this call (``_profiled``), closed on completion

    def __init__(self, result, last: _Pending | None):
        super().__init__()
        self._result, self._last = result, last

    def wait(self, timeout=None) -> bool:
        if _native is not None and _profiler_enabled():
            _record_wait(self._last.pg if self._last is not None else None, self._last)
        return self._complete()

    def _complete(self) -> bool:
        if self._last is not None and not self._last.done:
            with _COLLECTIVE_LOCK, _PLAIN():
                _complete_through(self._last)
        if self._profile:
            _end_profile(self)
        return True

    def is_completed(self) -> bool:
        last = self._last
        if last is not None and not last.done:
            with _COLLECTIVE_LOCK, _PLAIN():
                if not last.done:
                    upto = list(itertools.takewhile(lambda p: p is not last, _PENDING)) + [last]
                    if not all(p.ready() for p in upto):
                        return False
                    _complete_through(last)  # answered: copying out does not block
        if self._profile:
            _end_profile(self)
        return True

    def get_future(self):
        self._complete()
        fut = Future()
        fut.set_result(self._result)
        return fut

    def result(self):
        self._complete()
        return self._result


class MirageProcessGroup(dist.ProcessGroup):
    """A communicator of ``size`` ranks, matched in the daemon by a store-agreed id."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, cpu=None):
        super().__init__(rank, size)
        self._cpu = cpu  # gloo, for CPU tensors, when the group was asked for "cpu:gloo,cuda:nccl"
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._seq = 0
        self._p2p_seq: dict[tuple[s.CollOp, int], int] = {}  # messages so far, per (direction, peer)
        self._group_name = ""
        self._group_desc = ""
        self._in_process = os.environ.get("MIRAGE_IN_PROCESS") == "1"
        self._socket = False  # the data path: ZeroMQ frames (NET/Socket) or the arena; chosen below
        self._direct_ok = False  # whether small collectives may go rank to rank (``shim.direct``)
        self._rings: direct.PeerRings | None = None  # made at the first that does
        self._global_start_stride = _start_stride(_creating_ranks)  # what record_param_comms reports
        # the default group is built before torch records it (and again after destroy_process_group)
        self._is_default = not dist.is_initialized()
        global _faults_chosen
        if self._is_default and not _faults_chosen:  # once: a fault acted out stays done after a re-init
            _faults_chosen = True
            _FAULTS.extend(f for f in _PLANNED if f.rank == rank)
        if self._in_process:
            if size > 1:
                raise dist.DistBackendError(IN_PROCESS_MESSAGE)
            return
        # rank 0 mints the communicator id, as NCCL's ncclUniqueId travels through the store. A
        # store prefix can serve several groups (the same ranks split twice, init after destroy):
        # each rank's k-th group under it reads the k-th id.
        key = f"mirage_comm_id/{store.add(f'mirage_comm_count/{rank}', 1)}"
        if rank == 0:
            store.set(key, uuid.uuid4().hex)
        self._comm = store.get(key).decode()
        self._client = cl.client()
        host = os.environ.get("NCCL_HOSTID", socket.gethostname())
        transport = _transport(store, self._comm, rank, size, host)
        self._socket = transport == "socket"
        self._direct_ok = not self._socket and self._client.has_fast and direct.MAX_BYTES > 0
        reply = self._client.request(
            s.CommInit(
                comm=self._comm,
                rank=rank,
                size=size,
                # not $RANK: mp.spawn children all inherit their parent's
                global_rank=rank if self._is_default else dist.get_rank(),
                node=int(os.environ.get("MIRAGE_NODE_RANK", "0")),
                host=host,
                transport=transport,
            )
        )
        if isinstance(reply, s.Error):
            raise _nccl_error(reply.code, reply.message, dev.STATE.current)

    # -- identity (functional collectives, DTensor and FSDP2 look groups up by name)
    def getBackendName(self) -> str:
        return "nccl"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def _device_types(self) -> list[torch.device]:
        # what torch picks object-collective and state-dict broadcast devices from (the C++
        # group's registered types stay empty for a Python group): cuda, as a real NCCL group
        return [torch.device("cpu"), torch.device("cuda")] if self._cpu is not None else [torch.device("cuda")]

    # -- the engine: one collective, in the arena, through the daemon
    def _run(self, op: s.CollOp, inputs: list[torch.Tensor], out_numel: int, dtype: torch.dtype,
             deliver: Callable[[torch.Tensor], None] | None = None, reduce_op=s.ReduceOp.SUM, root: int = 0,
             device: int | None = None, stage: bool = True, splits: list[int] | None = None,
             numel: int | None = None, premul: float | None = None,
             owner: torch.Tensor | None = None) -> _Pending | None:
        """Post one collective; its flat output goes to ``deliver`` when its work completes.

        The inputs are staged (copied) now, so the caller may reuse them; the
        output is copied out when the work is waited on (or polled complete).
        An in-place collective (all-reduce, broadcast) of ``owner``, a large
        tensor whose data is ``inputs[0]``, may instead run on its storage
        itself (``shim.shared_buffers``): nothing is copied, the daemon writes
        the tensor while the collective runs, as a GPU does.
        Returns the posted collective, or None when there is nothing to wait for.
        """
        if self._is_default and _FAULTS and _inject(self._seq + 1):
            return None  # skipped: this rank's code "never called" it, so its sequence number stays
        staged_numel = sum(t.numel() for t in inputs)
        numel = staged_numel if numel is None else numel  # what the daemon matches (scatter: the share)
        device = dev.STATE.current if device is None else device
        if self._in_process:
            if deliver is not None:
                flat = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0, dtype=dtype)
                deliver(flat if premul is None else flat * premul)
            return None
        esize = dtype.itemsize
        out_off = cl.aligned(staged_numel * esize)
        same = op in (s.CollOp.ALLREDUCE, s.CollOp.BROADCAST)
        with _COLLECTIVE_LOCK, _PLAIN():
            if _PENDING:  # on a stream a collective reads its inputs after earlier ones wrote their outputs
                reads = _storages(inputs)
                for p in reversed(_PENDING):
                    if _storages(p.targets) & reads:
                        _complete_through(p)
                        break
            if self._socket:
                return self._post_socket(op, inputs, out_numel, dtype, deliver, reduce_op, root, device, stage,
                                         splits, numel, premul)
            # (never a communicator's first collective: that one connects it, and NCCL checks its GPUs then)
            if self._direct_ok and self._seq and direct.eligible(
                op, staged_numel * esize, str(dtype).removeprefix("torch."), reduce_op
            ):
                return self._post_direct(op, inputs, dtype, deliver, reduce_op, root, device, premul)
            shared = sb.of(self._client)
            shared.flush()
            zc = None
            if isinstance(owner, MirageTensor) and same and premul is None and len(inputs) == 1 and (
                deliver is None or getattr(deliver, "targets", [None])[0] is inputs[0]
            ):
                zc = shared.locate(owner, inputs[0])
            if zc is not None:  # zero-copy: in place in the rank's tensor, no arena
                slot, arena_name_, in_buf, in_off, out_off = -1, "", zc[0], zc[1], zc[1]
                staged, deliver, out_view = inputs[0], None, None
            else:
                slot = 0 if not _PENDING else min(set(range(1, len(_PENDING) + 2)) - _busy_slots)
                arena = _slot_arena(self._client, slot, out_off + (0 if same else out_numel * esize))
                staged = cl.arena_tensor(arena, 0, staged_numel, dtype)
                if stage:
                    at = 0
                    for t in inputs:
                        staged[at : at + t.numel()].copy_(t.reshape(-1))
                        at += t.numel()
                    if premul is not None:
                        staged.mul_(premul)
                arena_name_, in_buf, in_off, out_off = arena.name, 0, 0, 0 if same else out_off
                out_view = None if same else cl.arena_tensor(arena, out_off, out_numel, dtype)
            self._seq += 1
            request = s.Collective(
                comm=self._comm, seq=self._seq, rank=self._rank, op=op, reduce_op=reduce_op,
                dtype=str(dtype).removeprefix("torch."), numel=numel, out_numel=out_numel, root=root,
                # the node's GPU, not the visible ordinal: two ranks that each see "cuda:0"
                # through CUDA_VISIBLE_DEVICES are on different GPUs
                device=dev.STATE.physical[device], arena=arena_name_, in_off=in_off, out_off=out_off,
                site=_call_site(),
                splits=splits or [],
                in_buf=in_buf, out_buf=in_buf,
            )
            req = self._client.send(request)
            if slot >= 0:
                _busy_slots.add(slot)
            pending = _Pending(self, request, req, slot, staged, out_view, deliver, device, time.monotonic())
            if zc is not None:
                # nothing to deliver, but later collectives touching the tensor wait for this one
                # (it is written while this runs), and the tensor stays alive until then
                pending.targets = [staged]
            _PENDING.append(pending)
            return pending

    def _post_socket(self, op, inputs, out_numel, dtype, deliver, reduce_op, root, device, stage, splits, numel,
                     premul) -> _Pending:
        """``_run``'s socket transport (lock held): the inputs go as data frames, the output comes back as one."""
        self._seq += 1
        request = s.Collective(
            comm=self._comm, seq=self._seq, rank=self._rank, op=op, reduce_op=reduce_op,
            dtype=str(dtype).removeprefix("torch."), numel=numel, out_numel=out_numel, root=root,
            device=dev.STATE.physical[device], site=_call_site(), splits=splits or [], transport=s.Transport.SOCKET,
        )
        req = self._client.send(request, _payload(inputs, premul) if stage else None)
        # a broadcast's root gets nothing back (its output is its input), so it delivers that
        own = inputs[0].reshape(-1) if op is s.CollOp.BROADCAST and self._rank == root and inputs else None
        pending = _Pending(self, request, req, None, own, None, deliver, device, time.monotonic())
        _PENDING.append(pending)
        return pending

    def _post_direct(self, op, inputs, dtype, deliver, reduce_op, root, device, premul) -> _Pending:
        """``_run``'s rank-to-rank path (lock held; see ``shim.direct``): the input goes into this rank's
        ring, the request to the daemon, which answers only if something is wrong."""
        rings = self._rings
        if rings is None:
            try:
                rings = self._rings = direct.PeerRings(self._client.session, self._comm, self._rank, self._size)
            except direct.RingError as e:
                raise dist.DistBackendError(str(e)) from None
        index = rings.posted + 1
        numel = sum(t.numel() for t in inputs)
        self._seq += 1
        request = s.Collective(
            comm=self._comm, seq=self._seq, rank=self._rank, op=op, reduce_op=reduce_op,
            dtype=str(dtype).removeprefix("torch."), numel=numel, out_numel=numel, root=root,
            device=dev.STATE.physical[device], site=_call_site(), direct=True,
        )
        if not rings.slot_free(index):
            # its last user must be done on every rank: here first (in order, as on a stream), then the peers
            last = [p for p in _PENDING if p.pg is self and 0 < p.ring <= index - direct.SLOTS]
            if last:
                _complete_through(last[-1])
            deadline = time.monotonic() + self._timeout.total_seconds()
            while not rings.slot_free(index):
                if time.monotonic() > deadline:
                    raise self._watchdog_timeout(request, self._timeout.total_seconds())
                time.sleep(0.0002)
                self._client.check_daemon()

        data = None  # what this rank sends: its input (one tensor: all-reduce, broadcast), as bytes
        if numel and (op is not s.CollOp.BROADCAST or self._rank == root):
            t = inputs[0].reshape(-1) if len(inputs) == 1 else torch.cat([t.reshape(-1) for t in inputs])
            data = (t if premul is None else t * premul).view(torch.uint8).numpy().data

        pending = _Pending(self, request, 0, None, None, None, deliver, device, time.monotonic())
        pending.ring = rings.post(request.seq, op, request.dtype, numel, reduce_op, root, data)
        pending.req = self._client.defer(request)
        _PENDING.append(pending)
        return pending

    def _finish_direct(self, p: _Pending) -> None:
        """Complete a rank-to-rank collective (lock held): wait for every peer, then reduce or copy their inputs."""
        rings, req = self._rings, p.request
        deadline = p.posted_at + self._timeout.total_seconds()

        def check() -> None:  # between waits: the daemon must know this rank waits, and may have answered
            self._client.flush()
            if self._client.poll(p.req):  # the daemon answers only with an error
                self._reply(p)
            self._client.check_daemon()

        if not rings.wait(p.ring, deadline, check):
            raise self._watchdog_timeout(req, time.monotonic() - p.posted_at)
        if not rings.matches(p.ring):
            # the ranks disagree on what they run: the daemon sees it too, and its error names both sides
            self._client.flush()
            self._reply(p)
            raise dist.DistBackendError(f"mirage: collective #{req.seq} differs between ranks")
        dtype = getattr(torch, req.dtype)
        nbytes = req.numel * dtype.itemsize
        if req.op is s.CollOp.ALLREDUCE and req.numel:
            # one tensor (``_into``'s target: contiguous, not any rank's slot) is reduced into straight
            one = len(p.targets) == 1
            out = p.targets[0].reshape(-1) if one else torch.empty(req.numel, dtype=dtype)
            parts = [kernels.typed(x, req.dtype) for x in rings.inputs(p.ring, nbytes)]
            kernels.reduce_into(parts, req.reduce_op, req.dtype, kernels.typed(out.view(torch.uint8).numpy(), req.dtype))
            if not one:
                p.deliver(out)
        elif req.op is s.CollOp.BROADCAST and p.deliver is not None:
            p.deliver(torch.from_numpy(rings.inputs(p.ring, nbytes)[req.root]).view(dtype))
        rings.finish(p.ring)
        self._client.forget(p.req)

    def _reply(self, p: _Pending) -> s.Reply:
        """The daemon's answer to ``p`` once it comes; an error is raised, a wait past the timeout is the watchdog's."""
        left = self._timeout.total_seconds() - (time.monotonic() - p.posted_at)
        try:
            reply = self._client.wait(p.req, timeout_s=max(left, 0.001))
        except TimeoutError:
            raise self._watchdog_timeout(p.request, time.monotonic() - p.posted_at) from None
        if isinstance(reply, s.Error):
            raise _nccl_error(reply.code, reply.message, p.device)
        return reply

    def _watchdog_timeout(self, req: s.Collective, waited_s: float) -> dist.DistBackendError:
        """ProcessGroupNCCL's watchdog message, which is what users grep their logs for."""
        timeout_ms = int(self._timeout.total_seconds() * 1000)
        text = (
            f"[Rank {self._rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={req.seq}, "
            f"OpType={req.op.name}, NumelIn={req.numel}, NumelOut={req.out_numel}, Timeout(ms)={timeout_ms}) "
            f"ran for {int(waited_s * 1000)} milliseconds before timing out."
        )
        print(text, file=sys.stderr, flush=True)
        return dist.DistBackendError(text)

    def _done(self, result) -> dist.Work:
        """The work of the call that just posted its collectives: complete through the newest."""
        with _COLLECTIVE_LOCK:  # (another thread may be completing them)
            return _CollectiveWork(result, _PENDING[-1] if _PENDING else None)

    @_cpu_via_gloo
    @_profiled("nccl:all_reduce", "allreduce", 0)
    def allreduce(self, tensors, opts=None):
        red = _reduction(opts)
        for t in tensors:
            elem = _flat(t)
            self._run(s.CollOp.ALLREDUCE, [elem], elem.numel(), elem.dtype, _into(elem), device=_gpu(t), owner=t,
                      **red)
        return self._done(tensors)

    @_cpu_via_gloo
    @_profiled("nccl:broadcast", "broadcast", 0)
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            elem = _flat(t)
            mine = self._rank == root
            self._run(s.CollOp.BROADCAST, [elem], elem.numel(), elem.dtype, None if mine else _into(elem),
                      root=root, device=_gpu(t), stage=mine, owner=t)
        return self._done(tensors)

    @_cpu_via_gloo
    @_profiled("nccl:all_gather", "all_gather", 1, 0)
    def allgather(self, output_lists, inputs, opts=None):
        for outs, t in zip(output_lists, inputs):
            elem = _flat(t)
            n = elem.numel()
            if any(o.numel() != n for o in outs):
                # uneven sizes: one broadcast per rank, as ProcessGroupNCCL does
                for k, o in enumerate(outs):
                    buf = elem if k == self._rank else _flat(o)
                    self._run(s.CollOp.BROADCAST, [buf], buf.numel(), buf.dtype, _into(_flat(o)), root=k,
                              device=_gpu(t), stage=k == self._rank)
                continue
            self._run(s.CollOp.ALLGATHER, [elem], n * self._size, elem.dtype, _into_each([_flat(o) for o in outs]),
                      device=_gpu(t))
        return self._done(output_lists)

    @_cpu_via_gloo
    @_profiled("nccl:_all_gather_base", "_allgather_base", 1, 0)
    def _allgather_base(self, output, input, opts=None):
        elem = _flat(input)
        self._run(s.CollOp.ALLGATHER, [elem], output.numel(), elem.dtype, _into(_flat(output)), device=_gpu(input))
        return self._done([output])

    @_cpu_via_gloo
    @_profiled("nccl:_reduce_scatter_base", "_reduce_scatter_base", 1, 0)
    def _reduce_scatter_base(self, output, input, opts=None):
        elem = _flat(input)
        self._run(s.CollOp.REDUCE_SCATTER, [elem], output.numel(), elem.dtype, _into(_flat(output)),
                  device=_gpu(input), **_reduction(opts))
        return self._done([output])

    @_cpu_via_gloo
    @_profiled("nccl:reduce", "reduce", 0)
    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            elem = _flat(t)
            mine = self._rank == root
            # NCCL leaves non-root buffers as they were: only the root receives
            self._run(s.CollOp.REDUCE, [elem], elem.numel() if mine else 0, elem.dtype,
                      _into(elem) if mine else None, root=root, device=_gpu(t), **_reduction(opts))
        return self._done(tensors)

    @_cpu_via_gloo
    @_profiled("nccl:gather", "gather", 1, 0)
    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        elem = _flat(inputs[0])
        outs = [_flat(o) for o in output_lists[0]] if output_lists else []
        if outs and (len(outs) != self._size or any(o.numel() != elem.numel() for o in outs)):
            raise ValueError("Tensor list output of gather must match number of collective participants "
                             "and each tensor the input's size")
        self._run(s.CollOp.GATHER, [elem], elem.numel() * self._size if outs else 0, elem.dtype,
                  _into_each(outs) if outs else None, root=root, device=_gpu(inputs[0]))
        return self._done(output_lists)

    @_cpu_via_gloo
    @_profiled("nccl:scatter", "scatter", 1, 0)
    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = _flat(outputs[0])
        sources = [_flat(t) for t in input_lists[0]] if input_lists else []
        if sources and (len(sources) != self._size or any(t.numel() != out.numel() for t in sources)):
            raise ValueError("Tensor list input to scatter must match number of collective participants "
                             "and each tensor the output's size")
        # numel is the per-rank share, the same on every rank; only the root stages its list
        self._run(s.CollOp.SCATTER, sources, out.numel(), out.dtype, _into(out), root=root,
                  device=_gpu(outputs[0]), stage=bool(sources), numel=out.numel())
        return self._done(outputs)

    @_cpu_via_gloo
    @_profiled("nccl:reduce_scatter", "reduce_scatter", 1, 0)
    def reduce_scatter(self, outputs, input_lists, opts=None):
        out = _flat(outputs[0])
        parts = [_flat(t) for t in input_lists[0]]
        red = _reduction(opts)
        if any(p.numel() != out.numel() for p in parts):
            # uneven parts: one reduce per destination rank, as ProcessGroupNCCL does
            for k, part in enumerate(parts):
                self._run(s.CollOp.REDUCE, [part], part.numel() if k == self._rank else 0, part.dtype,
                          _into(out) if k == self._rank else None, root=k, device=_gpu(outputs[0]), **red)
            return self._done(outputs)
        self._run(s.CollOp.REDUCE_SCATTER, parts, out.numel(), out.dtype, _into(out), device=_gpu(outputs[0]),
                  **red)
        return self._done(outputs)

    @_cpu_via_gloo
    @_profiled("nccl:all_to_all", "all_to_all", 1, 0)
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        src, dst = _flat(input), _flat(output)
        for t, sizes, what in ((src, input_split_sizes, "input"), (dst, output_split_sizes, "output")):
            rows = t.size(0) if t.dim() else 1
            if sizes and (len(sizes) != self._size or sum(sizes) != rows):
                raise ValueError(f"Split sizes doesn't match total dim 0 size ({what}: {list(sizes)} for {rows} rows)")
            if not sizes and rows % self._size:
                raise ValueError(f"Tensor's dim 0 does not divide equally across group size ({what}: {rows} rows)")
        # torch counts splits in rows of dim 0; the daemon in elements
        row = src[0].numel() if src.dim() > 0 and src.size(0) else 1
        splits = [n * row for n in input_split_sizes] if input_split_sizes else [src.numel() // self._size] * self._size
        self._run(s.CollOp.ALLTOALL, [src], dst.numel(), src.dtype, _into(dst), device=_gpu(input), splits=splits)
        return self._done([output])

    all_to_all_single = alltoall_base

    @_cpu_via_gloo
    @_profiled("nccl:all_to_all", "all_to_all", 1, 0)
    def alltoall(self, outputs, inputs, opts=None):
        srcs = [_flat(t) for t in inputs]
        outs = [_flat(t) for t in outputs]
        self._run(s.CollOp.ALLTOALL, srcs, sum(o.numel() for o in outs), srcs[0].dtype, _into_each(outs),
                  device=_gpu(inputs[0]), splits=[t.numel() for t in srcs])
        return self._done(outputs)

    @_cpu_via_gloo
    @_profiled("nccl:all_reduce_coalesced", "allreduce_coalesced", 0)
    def allreduce_coalesced(self, tensors, opts=None):
        # one flat all-reduce over the concatenation, as NCCL's grouped calls amount to
        elems = [_flat(t) for t in tensors]
        self._run(s.CollOp.ALLREDUCE, elems, sum(e.numel() for e in elems), elems[0].dtype, _into_each(elems),
                  device=_gpu(tensors[0]), **_reduction(opts))
        return self._done(tensors)

    # the coalesced tensor forms (functional collectives, DTensor, FSDP2): one collective per pair,
    # in order, as NCCL's grouped calls amount to
    @_cpu_via_gloo
    @_profiled("nccl:all_gather_into_tensor_coalesced", "allgather_into_tensor_coalesced", 1, 0)
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            elem = _flat(inp)
            self._run(s.CollOp.ALLGATHER, [elem], out.numel(), elem.dtype, _into(_flat(out)), device=_gpu(inp))
        return self._done(outputs)

    @_cpu_via_gloo
    @_profiled("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", 1, 0)
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        red = _reduction(opts)
        for out, inp in zip(outputs, inputs):
            elem = _flat(inp)
            self._run(s.CollOp.REDUCE_SCATTER, [elem], out.numel(), elem.dtype, _into(_flat(out)),
                      device=_gpu(inp), **red)
        return self._done(outputs)

    # -- point to point: asynchronous, each message in a shared-memory buffer of its own
    def _p2p(self, op: s.CollOp, tensor: torch.Tensor, peer: int) -> _P2PWork:
        if self._in_process:
            raise dist.DistBackendError(IN_PROCESS_MESSAGE)
        elem = _flat(tensor)
        key = (op, peer)
        self._p2p_seq[key] = n = self._p2p_seq.get(key, 0) + 1
        request = s.Collective(
            comm=self._comm, seq=n, rank=self._rank, op=op, dtype=str(elem.dtype).removeprefix("torch."),
            numel=elem.numel(), out_numel=elem.numel(), device=dev.STATE.physical[_gpu(tensor)], peer=peer,
            site=_call_site(),
        )
        if self._socket:  # the message travels as a data frame, to the daemon and back
            payload = _payload([elem], None) if op is s.CollOp.SEND else None
            req = self._client.send(dataclasses.replace(request, transport=s.Transport.SOCKET), payload)
            arena = buf = None
        else:
            arena = self._client.scratch(elem.numel() * elem.element_size())
            buf = cl.arena_tensor(arena, 0, elem.numel(), elem.dtype)
            if op is s.CollOp.SEND:
                buf.copy_(elem.reshape(-1))
            req = self._client.send(dataclasses.replace(request, arena=arena.name))
        deliver = None if op is s.CollOp.SEND else _into(elem)
        return _P2PWork(self, req, arena, buf, deliver, _gpu(tensor), [tensor])

    @_profiled("nccl:send {rank}->{peer}", "send", 0)
    def send(self, tensors, dstRank, tag=0):
        return self._p2p(s.CollOp.SEND, tensors[0], dstRank)

    @_profiled("nccl:recv {rank}<-{peer}", "recv", 0)
    def recv(self, tensors, srcRank, tag=0):
        return self._p2p(s.CollOp.RECV, tensors[0], srcRank)

    # the names torch.distributed calls from Python for the tensor forms
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base

    @_profiled("nccl:all_reduce", "barrier", 1)
    def barrier(self, opts=None):
        self._run(s.CollOp.BARRIER, [], 0, torch.float32)
        return self._done([])


class _P2PWork(dist.Work):
    """A send or receive in flight: ``wait`` blocks until the daemon has copied the message."""

    def __init__(self, pg: MirageProcessGroup, req: int, arena, buf, deliver, device: int, tensors):
        super().__init__()
        self._pg, self._req, self._arena, self._buf = pg, req, arena, buf
        self._deliver, self._device, self._tensors = deliver, device, tensors
        self._done = False
        self._profile = None  # the profiler's open event for this message (``_profiled``)

    def wait(self, timeout=None) -> bool:
        if _native is not None and _profiler_enabled():
            _record_wait(self._pg, None)
        if self._done:
            return True
        seconds = self._pg._timeout.total_seconds() if not timeout else timeout.total_seconds()
        try:
            reply = self._pg._client.wait(self._req, seconds)
            if isinstance(reply, s.Error):
                raise _nccl_error(reply.code, reply.message, self._device)
            if self._arena is None:  # socket transport: a receive's message came with the reply
                data = self._pg._client.data(self._req)
                if self._deliver is not None:
                    t = self._tensors[0]
                    self._deliver(_received(data, t.numel(), str(t.dtype).removeprefix("torch.")))
            elif self._deliver is not None:
                self._deliver(self._buf)
        finally:
            self._done = True
            self._buf = None
            if self._arena is not None:
                self._arena.close()
                self._arena.unlink()
            if self._profile:
                _end_profile(self)
        return True

    def is_completed(self) -> bool:
        return self._done or self._pg._client.poll(self._req)

    def get_future(self):
        fut = Future()
        self.wait()
        fut.set_result(self._tensors)
        return fut


def _transport(store: dist.Store, comm: str, rank: int, size: int, host: str) -> str:
    """The communicator's data path, chosen as RCCL chooses its transport (see ``nccl_debug``).

    ``"socket"`` (NET/Socket: ZeroMQ frames) with P2P and SHM both disabled, or
    when a member runs on another emulated node; else ``"shm"``. Only a
    multi-node run has to ask where the members are: each rank writes its host
    to the store and reads everyone's, as NCCL's bootstrap all-gathers them.
    """
    if nccl_debug.net_only():
        return "socket"
    if size == 1 or int(os.environ.get("MIRAGE_NUM_NODES", "1") or "1") <= 1:
        return "shm"
    store.set(f"mirage_host/{comm}/{rank}", host)
    hosts = store.multi_get([f"mirage_host/{comm}/{r}" for r in range(size)])
    return "socket" if any(h.decode() != host for h in hosts) else "shm"


def _start_stride(ranks: list[int]) -> tuple[int, int]:
    """A group's first global rank and the stride between its ranks (-1: uneven), as ProcessGroupNCCL has them."""
    if not ranks:  # the default group
        return 0, 1
    if len(ranks) == 1:
        return ranks[0], 0
    stride = ranks[1] - ranks[0]
    even = all(b - a == stride for a, b in zip(ranks, ranks[1:]))
    return ranks[0], stride if even else -1


def _create(store, rank, size, timeout):
    return MirageProcessGroup(store, rank, size, timeout)


def _create_with_gloo(store, rank, size, timeout):
    return MirageProcessGroup(store, rank, size, timeout, cpu=dist.ProcessGroupGloo(
        dist.PrefixStore("cpu/", store), rank, size, timeout=timeout))


def _to_mirage(backend) -> str | None:
    """Our backend for a requested one: cuda-only, or with gloo for CPU tensors (mixed or unspecified)."""
    text = "undefined" if backend is None else str(backend)
    if text == "undefined" or ("nccl" in text and "cpu:" in text):
        return NAME_WITH_GLOO
    return NAME if "nccl" in text else backend


def _split_group(split_group):
    """``dist.split_group`` for our groups: each split becomes a group of its members.

    torch splits through the C++ backend (``ncclCommSplit``); ours is a Python
    group, so the split is made as ``new_group`` over the member ranks, which
    only those members enter, as only they enter ``ncclCommSplit``'s child.
    """

    @functools.wraps(split_group)
    def split(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
        parent = parent_pg or c10d._get_default_group()
        if dist.get_backend(parent) != "nccl":  # a CPU build has no other nccl than ours
            return split_group(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
        if not split_ranks:
            raise ValueError("split_ranks cannot be None or empty")
        me = parent.rank()
        to_global = dist.get_process_group_ranks(parent)
        mine = None
        for ranks in split_ranks:
            if not ranks:
                raise ValueError("the split group cannot be empty")
            if len(ranks) > dist.get_world_size():
                raise ValueError("the split group's size should be less or equal to the world_size set by "
                                 "init_process_group")
            if len(ranks) != len(set(ranks)):
                raise ValueError("the split group cannot have duplicate ranks")
            if me in ranks:
                mine = sorted(ranks)
        if mine is None:
            return None
        return dist.new_group([to_global[r] for r in mine], timeout=timeout, backend=backend, pg_options=pg_options,
                              use_local_synchronization=True, group_desc=group_desc)

    return split


UNUSED_PARAMETERS_MESSAGE = (
    "mirage: DistributedDataParallel({arg}=True) needs mirage's pinned host allocator, which this "
    "machine lacks: {why}. DDP's reducer exchanges its map of used parameters through pinned host "
    "memory. Install a C++ compiler (or set CXX) and run again, or make every parameter take part "
    "in the loss and drop {arg}. See docs/compatibility.md."
)


def _refuse_unused_parameters(init):
    """``DistributedDataParallel.__init__`` refusing, by name, what would abort at the first backward.

    Only without the native pinned allocator (``shim/pinned.py``), which the reducer needs for these.
    """

    @functools.wraps(init)
    def checked(self, module, *args, **kwargs):
        for arg in ("find_unused_parameters", "static_graph"):
            if kwargs.get(arg) and any(isinstance(p, MirageTensor) for p in module.parameters()):
                raise NotImplementedError(UNUSED_PARAMETERS_MESSAGE.format(arg=arg, why=pinned.NATIVE_ERROR))
        return init(self, module, *args, **kwargs)

    return checked


def _on_module_gpu(method):
    """A ``DistributedDataParallel`` method run with C++ allocations on its module's emulated GPU.

    DDP's C++ (its parameter check, the reducer's buckets, built at construction or unpickling and
    rebuilt in ``forward``) allocates on its parameters' device, which C++ sees as the backend's one device
    for every emulated GPU: without this it landed on the *current* GPU, so a program that moves
    its model to ``cuda:1`` without ``set_device(1)`` (as PyTorch's own DDP tests do) had rank 1's
    buckets on GPU 0 and NCCL's "Duplicate GPU detected".
    """

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        # forward: self.module; __init__(module, ...); __setstate__(state): the pickled module
        state = args[0] if args and isinstance(args[0], dict) else {}
        modules = self.__dict__.get("_modules") or state.get("_modules") or {}
        module = modules.get("module") or (args[0] if args else kwargs.get("module"))
        first = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
        if not isinstance(first, MirageTensor):
            return method(self, *args, **kwargs)
        with dev.allocating_on(first._gpu):
            return method(self, *args, **kwargs)

    return run


def _finalizing(destroy):
    """``destroy_process_group`` completing the group's posted collectives first (all of them for the
    world), as ``ncclCommFinalize`` does: nothing the daemon may still read is let go under it."""

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            _drain()
        elif group is not dist.GroupMember.NON_GROUP_MEMBER:
            _drain(group.group_name)
        return destroy(group)

    return destroy_process_group


def _set_pg_timeout(set_timeout):
    """``_set_pg_timeout`` (torchtitan calls it after its first step) for our groups, which are their own backend.

    torch's looks for a ``ProcessGroupNCCL`` behind the group, which a CPU
    build does not have; the watchdog's deadline here is the group's timeout.
    """

    @functools.wraps(set_timeout)
    def setter(timeout, group=None):
        pg = c10d._get_default_group() if group is None else group
        if not isinstance(pg, MirageProcessGroup):  # another backend's (a device mesh's gloo or fake group)
            return set_timeout(timeout, group)
        pg._timeout = timeout
        if pg._cpu is not None:
            pg._cpu._set_default_timeout(timeout)
        return None

    return setter


class _NoProcessGroupNCCL:
    """Stands for ``ProcessGroupNCCL``, which a CPU build lacks while ``is_nccl_available()`` is True here.

    c10d tests ``is_nccl_available() and isinstance(backend, ProcessGroupNCCL)``
    (``_set_pg_timeout`` on a device mesh's groups): no group is one, as for a
    group of another backend on a GPU build; ours are handled where c10d calls them.
    """


def install() -> None:
    """Register the backend and route ``"nccl"`` to it, keeping the name ``"nccl"`` visible."""
    dist.Backend.register_backend(NAME, _create, devices=["cuda", NAME])
    dist.Backend.register_backend(NAME_WITH_GLOO, _create_with_gloo, devices=["cpu", "cuda", NAME])
    helper = c10d._new_process_group_helper
    register = c10d._register_pg_in_world
    asked: list[str] = []  # what the user asked for, shown back by get_backend

    def new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        ours = _to_mirage(backend)
        if ours in (NAME, NAME_WITH_GLOO):
            asked.append("nccl" if ours == NAME else str(backend))
            kwargs["device_id"] = None  # eager init needs a C++ backend per device; ours connects lazily
        _creating_ranks[:] = global_ranks_in_group or []
        try:
            return helper(group_size, group_rank, global_ranks_in_group, ours, *args, **kwargs)
        finally:
            _creating_ranks.clear()

    def register_pg_in_world(pg, *args, backend_name=None, backend_config=None, **kwargs):
        if str(backend_name) in (NAME, NAME_WITH_GLOO):
            backend_name = asked.pop()
            # "cuda:mirage,mirage:mirage" reads "cuda:nccl" (our device is an implementation detail),
            # a mixed group "cpu:gloo,cuda:nccl"
            backend_config = ",".join(
                f"{device}:{('gloo' if device == 'cpu' else 'nccl') if be in (NAME, NAME_WITH_GLOO) else be}"
                for device, be in (entry.split(":", 1) for entry in backend_config.split(","))
                if device != NAME
            )
        return register(pg, *args, backend_name=backend_name, backend_config=backend_config, **kwargs)

    c10d.split_group = dist.split_group = _split_group(c10d.split_group)
    ddp = torch.nn.parallel.DistributedDataParallel
    ddp.__init__ = _on_module_gpu(ddp.__init__)
    ddp.forward = _on_module_gpu(ddp.forward)
    ddp.__setstate__ = _on_module_gpu(ddp.__setstate__)  # a pickled DDP builds its reducer again
    if pinned.NATIVE_ERROR is not None:
        ddp.__init__ = _refuse_unused_parameters(ddp.__init__)
    c10d._new_process_group_helper = new_process_group_helper
    c10d.destroy_process_group = dist.destroy_process_group = _finalizing(c10d.destroy_process_group)
    c10d._set_pg_timeout = _set_pg_timeout(c10d._set_pg_timeout)
    if not hasattr(c10d, "ProcessGroupNCCL"):
        c10d.ProcessGroupNCCL = _NoProcessGroupNCCL
    _load_native()
    c10d._register_pg_in_world = register_pg_in_world
    c10d._NCCL_AVAILABLE = True
    # ProcessGroupNCCL's default timeout (10 minutes), which a CPU build leaves unset
    c10d.default_pg_nccl_timeout = timedelta(minutes=10)
