"""What torch.profiler sees of a collective, as ProcessGroupNCCL records it (``shim/native/comms_native.cpp``).

"record_param_comms" around posting, with the collective's metadata, and an
async "nccl:<op>" event with the call's inputs from posting until its work
completes; "record_param_comms" named "wait" when a work is waited on. The
same library registers DDP's timer for the emulated device.
"""

from __future__ import annotations

import ctypes
import functools
from types import MappingProxyType

import torch

from shim.native import build as native_build

#: the library, or None: see NATIVE_ERROR
_native: ctypes.CDLL | None = None
#: None once loaded; else why not (one line): then no profiler events, and DDP reports no times
NATIVE_ERROR: str | None = "shim.transport.profiler.load() has not run"
_profiler_enabled = torch._C._autograd._profiler_enabled
#: c10's ScalarType numbering, which ParamCommsDebugInfo records as the collective's dtype
_SCALAR_TYPE = MappingProxyType({
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.complex32: 8, torch.complex64: 9, torch.complex128: 10,
    torch.bool: 11, torch.bfloat16: 15,
})
_Handle = ctypes.c_void_p


def load() -> None:
    """Build (once, cached) and load the native library; on failure, :data:`NATIVE_ERROR` says why."""
    global _native, NATIVE_ERROR
    try:
        lib = native_build.load(native_build.COMMS_SOURCE, "the collectives' profiler events and DDP's timer")
    except native_build.BuildError as e:
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


def listening() -> bool:
    """Whether a profiler records now (and events can be recorded)."""
    return _native is not None and _profiler_enabled()


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


def profiled(title: str, coll: str, inputs: int, outputs: int | None = None):
    """Record a process group method's calls for torch.profiler as ProcessGroupNCCL does (when one listens).

    ``title`` is the async event's name (``{rank}``/``{peer}`` filled in for
    point-to-point), ``coll`` record_param_comms' collective name, ``inputs`` and
    ``outputs`` the argument positions of the input and output tensors. The
    group's ``_comm`` (``transports.Comm``) gives its identity and sequence number.
    """

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if _native is None or not _profiler_enabled():
                return method(self, *args, **kwargs)
            comm = self._comm
            ins = _tensors_of(args[inputs]) if inputs < len(args) else []
            outs = _tensors_of(args[outputs]) if outputs is not None and outputs < len(args) else ins
            peer = args[1] if title.endswith("}") and len(args) > 1 else None
            name = title.format(rank=comm.rank, peer=peer)
            in_arr, _in_keep = _impls(ins)
            out_arr, _out_keep = _impls(outs)
            in_splits = out_splits = None
            if method.__name__ == "alltoall_base":
                out_splits, in_splits = args[2], args[3]
            in_s, n_in_s = _ints(in_splits)
            out_s, n_out_s = _ints(out_splits)
            start, stride = comm.start_stride
            pc = _native.mirage_param_comms_begin(
                comm.seq + 1, comm.group_name.encode(), comm.group_desc.encode(), comm.rank, coll.encode(),
                sum(t.numel() for t in ins), sum(t.numel() for t in outs),
                _SCALAR_TYPE.get(ins[0].dtype if ins else torch.float32, 6), in_arr, len(ins), out_arr, len(outs),
                in_s, n_in_s, out_s, n_out_s, start, stride, comm.size,
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


def record_wait(comm, last) -> None:
    """The "record_param_comms" event named "wait" that ProcessGroupNCCL's ``WorkNCCL::wait`` records:
    ``comm`` the communicator (``transports.Comm``, or None), ``last`` the collective waited for (or None)."""
    empty, _ = _ints([])
    name, desc = (comm.group_name, comm.group_desc) if comm is not None else ("", "")
    handle = _native.mirage_param_comms_begin(
        last.request.seq if last is not None else -1, name.encode(), desc.encode(),
        comm.rank if comm is not None else -1, b"wait", 0, 0, 0, empty, 0, empty, 0, empty, 0, empty, 0, -1, -1, 1)
    if handle:
        _native.mirage_param_comms_end(handle)


def end(work) -> None:
    """Close a completed work's profiler event, once."""
    handle, work._profile = work._profile, None
    if handle:
        _native.mirage_work_end(handle)
