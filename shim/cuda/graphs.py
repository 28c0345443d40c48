"""CUDA/HIP graphs on the emulated GPUs: ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``, ``make_graphed_callables``.

On a GPU, capture records the kernels a stream is given without running
them, and each ``replay()`` runs them again on the same memory. Here capture
is a ``TorchDispatchMode`` on the capturing thread: every op on an emulated
tensor is recorded with its arguments and its outputs, and ``replay()`` runs
the recorded ops in order, writing each result into the output tensor the
capture made (the program and later ops hold those: static outputs, as on a
GPU), and running in-place ops in place again. What the GPU does not do
during capture is undone at its end: the ops run (their outputs' shapes and
later ops need them), so tensors that existed before the capture and that it
wrote to (a parameter an optimizer step updated, a gradient accumulated) get
their values back, and the first replay makes the first update, as on a GPU.

Refused during capture, as a GPU refuses them: what makes the host wait for
the device (``.item()``, a blocking copy to the host) raises
``operation not permitted when stream is capturing``. Not emulated: a
collective during capture (ours are not kernels on a stream) raises naming
it; memory pools are tokens only (a graph's outputs stay allocated while the
graph lives, as in its private pool).
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shim.rank.runtime import RUNTIME
from shim.tensor.wrapper import MirageTensor, _synchronizes

#: what a GPU build says when a capturing stream is asked to wait
NOT_PERMITTED = ("CUDA error: operation not permitted when stream is capturing\n"
                 "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                 "below might be incorrect.")
COLLECTIVE_REFUSED = ("mirage: a collective during CUDA graph capture is not emulated (it would not be replayed); "
                      "capture the compute only, and run collectives outside the graph")

_capturing = threading.local()


def capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()``: whether this thread is capturing a graph."""
    return getattr(_capturing, "graph", None) is not None


def refuse_collective() -> None:
    """Raise if this thread is capturing: collectives are not recorded (``shim/comm/process_group.py`` asks)."""
    if capturing():
        raise RuntimeError(COLLECTIVE_REFUSED)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (its in-place and ``out=`` arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out.extend(_tensors(value))
    return out


class _Recorder(TorchDispatchMode):
    """The capturing thread's mode: runs each op, and records it for :meth:`CUDAGraph.replay`."""

    def __init__(self, graph: CUDAGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.graph
        if func.namespace.startswith("_c10d_functional"):
            raise RuntimeError(COLLECTIVE_REFUSED)
        if _synchronizes(func, args, kwargs) and any(isinstance(t, MirageTensor) for t in _tensors((args, kwargs))):
            raise RuntimeError(NOT_PERMITTED)
        for t in _written(func, args, kwargs):
            if isinstance(t, MirageTensor) and id(t) not in g._made:
                g._keep(t)
        out = func(*args, **kwargs)
        g._ops.append((func, args, kwargs, out))
        g._made.update(id(t) for t in _tensors(out))
        return out


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` for the emulated GPUs (see the module docstring)."""

    def __init__(self, keep_graph: bool = False):
        self._ops: list[tuple] = []  # (op, args, kwargs, outputs) in capture order
        self._made: set[int] = set()  # ids of the tensors the capture made (held by _ops)
        self._kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # values to restore at the end
        self._recorder: _Recorder | None = None
        self._pool = (0, next(RUNTIME.cuda.graph_pools))
        self._captured = False

    def _keep(self, t: torch.Tensor) -> None:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self._kept:
            self._kept[key] = (t, t.detach().clone())

    def capture_begin(self, pool=None, capture_error_mode: str = "global", check_input_liveness: bool = False):
        """Start recording this thread's ops (``pool``, ``capture_error_mode`` are accepted, and change nothing)."""
        if capturing():
            raise RuntimeError("Cannot capture a graph while another capture is underway on this thread")
        self.reset()
        self._recorder = _Recorder(self)
        self._recorder.__enter__()
        _capturing.graph = self

    def capture_end(self) -> None:
        """Stop recording; tensors from before the capture that it wrote to get their values back."""
        if self._recorder is None:
            raise RuntimeError("capture_end() called without capture_begin()")
        _capturing.graph = None
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        with torch.no_grad():
            for t, value in reversed(list(self._kept.values())):
                t.copy_(value)
        self._kept.clear()
        self._captured = True

    def instantiate(self) -> None:
        """Nothing to build: the recorded ops are the graph."""

    def replay(self) -> None:
        """Run the recorded ops again, their results landing in the capture's outputs."""
        if not self._captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        with torch.no_grad():
            for func, args, kwargs, out in self._ops:
                if func.is_view:
                    continue  # a view of memory the capture holds already
                new = func(*args, **kwargs)
                for old, fresh in zip(_tensors(out), _tensors(new)):
                    if fresh is not old and fresh.data_ptr() != old.data_ptr():
                        old.copy_(fresh)

    def reset(self) -> None:
        """Forget the recorded ops (their outputs are freed when nothing else holds them)."""
        self._ops, self._made, self._captured = [], set(), False

    def pool(self):
        """A token for this graph's memory pool (pools are not modelled: any token is accepted)."""
        return self._pool

    def enable_debug_mode(self) -> None:
        """Nothing to debug: the recorded ops are Python objects."""

    def debug_dump(self, debug_path: str) -> None:
        """Write the recorded ops, one per line, to ``debug_path``."""
        with open(debug_path, "w", encoding="utf-8") as f:
            for func, *_ in self._ops:
                f.write(f"{func}\n")

    def raw_cuda_graph(self) -> int:
        raise RuntimeError("mirage: an emulated CUDA graph has no cudaGraph_t")

    def raw_cuda_graph_exec(self) -> int:
        raise RuntimeError("mirage: an emulated CUDA graph has no cudaGraphExec_t")


def install() -> None:
    """Make ``torch.cuda``'s graph API the emulated one (a CPU build's only raises)."""
    import torch.cuda.graphs as graphs

    torch.cuda.CUDAGraph = graphs.CUDAGraph = CUDAGraph
    pool = lambda: (0, next(RUNTIME.cuda.graph_pools))  # noqa: E731
    torch.cuda.graph_pool_handle = graphs.graph_pool_handle = graphs._graph_pool_handle = pool
    torch.cuda.is_current_stream_capturing = graphs.is_current_stream_capturing = capturing
    graphs._cuda_isCurrentStreamCapturing = torch._C._cuda_isCurrentStreamCapturing = capturing
    if not hasattr(torch._C, "_host_emptyCache"):  # torch.cuda.graph's __enter__ empties the pinned cache
        torch._C._host_emptyCache = lambda: None
