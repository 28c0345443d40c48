"""Clocked mode prices what compiled code runs: the kernels inductor generated, not the eager ops they replace.

A compiled graph runs on the host without a dispatch per op (shim/compile/torch_compile.py),
so shim/clock/clock.py sees none of its ops. Inductor knows each kernel it generates
(a fusion of pointwise and reduction ops, or an extern kernel such as a GEMM):
as it schedules a graph, each kernel's FLOPs (``estimate_flops``: the GEMMs and
convolutions it holds; an attention kernel's, and the rate it runs at, as the eager
op's: shim/clock/attention.py) and the bytes it reads and writes
(``get_read_write_buffers_sizes``: its inputs and outputs in memory, not what it
keeps in registers) are kept with the compiled graph, and each call of the graph
runs them one after another on the current stream, each timed by the roofline
as one kernel (:func:`shim.clock.roofline.kernel_cost`). A fused kernel thus costs its
memory traffic once, where the eager ops it replaces each read and wrote theirs.

Inductor's caches are off in clocked mode: a graph found in the cache is not
scheduled, and would run unpriced.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch

from shim.clock.attention import Attention, attention, is_attention
from shim.import_hooks import after_import
from shim.rank.runtime import RUNTIME

_pending = threading.local()  # the kernels scheduled since the last compiled graph was made


def _kernel(node) -> tuple | None:
    """``(name, flops, bytes, dtype, attention)`` of the kernel a scheduler node stands for (``attention``: the
    :class:`~shim.clock.attention.Attention` of an extern attention kernel, else None); None for one that runs none."""
    from torch._inductor.ir import MultiOutput
    from torch._inductor.scheduler import NopKernelSchedulerNode

    if isinstance(node, NopKernelSchedulerNode) or isinstance(node.node, MultiOutput):
        return None  # a MultiOutput takes one output of a kernel of several (``buf1 = buf0[0]``): no kernel
    ops = sorted({_op_name(origin) for n in node.get_nodes() if n.node is not None for origin in n.node.get_origins()})
    name = ("extern_" if node.is_extern() else "fused_") + "_".join(ops)[:80]
    try:
        flops = node.estimate_flops() or _fallback_flops(node) or None
    except Exception:  # noqa: BLE001 - an estimate inductor cannot make: the kernel is timed by its bytes
        flops = None
    attn = _attention(node)
    if attn is not None:
        flops = attn.flops  # the pairs it computes (a causal pass half of them), not torch's count of all
    nbytes = int(node.get_read_write_buffers_sizes())
    dtype = next(filter(None, map(_dtype, node.get_nodes())), None)
    if flops is not None and dtype is None:
        dtype = torch.float32  # a kernel whose buffers name no dtype: the math at the fp32 rate
    return name, flops, nbytes, dtype, attn


def _attention(node) -> Attention | None:
    """What an extern kernel running one attention op computes, from its FX node's op and fake-tensor
    arguments, so a compiled graph's attention is priced as the eager op is (its FLOPs and rate)."""
    if not node.is_extern() or node.node is None:
        return None
    from torch.fx.node import map_arg

    for origin in node.node.get_origins():
        if is_attention(origin.target):
            value = functools.partial(_meta_value, origin)
            return attention(origin.target, map_arg(origin.args, value), map_arg(origin.kwargs, value))
    return None


def _meta_value(origin, arg):
    """The fake tensor (or value) an FX node argument of ``origin`` stands for."""
    if "val" not in arg.meta:
        raise RuntimeError(f"mirage: clocked mode cannot price {origin.target}: its argument {arg} has no value")
    return arg.meta["val"]


def _fallback_flops(node) -> int | None:
    """The FLOPs of an extern kernel that runs one ATen op inductor has no lowering for (a ``FallbackKernel``:
    SDPA on the host), whose FX node inductor's estimate does not find (it has no ``origin_node``)."""
    from torch._inductor.fx_utils import count_flops_fx, countable_fx

    if not node.is_extern() or node.node is None or node.node.get_origin_node() is not None:
        return None
    counted = [o for o in node.node.get_origins() if countable_fx(o)]
    return count_flops_fx(counted[0]) if len(counted) == 1 else None


def _dtype(node) -> torch.dtype | None:
    """The dtype of a scheduler node's buffer, or of its first input's for a kernel of several outputs.

    Such a kernel's buffer (SDPA's output and log-sum-exp, say: a ``MultiOutputLayout``) has
    no dtype of its own, and asking inductor for it raises; it computes in its inputs'.
    """
    from torch._inductor.ir import MultiOutputLayout

    buffer = node.node
    if buffer is None or not hasattr(buffer, "get_dtype"):
        return None
    if not isinstance(getattr(buffer, "layout", None), MultiOutputLayout):
        return buffer.get_dtype()
    for i in getattr(buffer, "inputs", ()):
        if hasattr(i, "get_dtype"):
            return i.get_dtype()
    return None


def _op_name(origin) -> str:
    """``add`` for the FX node of ``aten.add.Tensor`` (inductor names its kernels by the ops fused in them)."""
    target = origin.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)


def _scheduling(init):
    def scheduler_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kernels = getattr(_pending, "kernels", None)
        if kernels is None:
            kernels = _pending.kernels = []
        kernels.extend(k for k in map(_kernel, self.nodes) if k is not None)

    return scheduler_init


def _keeping(init):
    def compiled_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.mirage_kernels = getattr(_pending, "kernels", None) or []
        _pending.kernels = []

    return compiled_init


def _charging(call):
    def compiled_call(self, inputs):
        kernels = getattr(self, "mirage_kernels", None)
        if kernels and RUNTIME.clock is not None:
            RUNTIME.clock.fused(RUNTIME.device.current, kernels)
        return call(self, inputs)

    return compiled_call


def _hook_scheduler() -> None:
    scheduler = sys.modules["torch._inductor.scheduler"].Scheduler
    scheduler.__init__ = _scheduling(scheduler.__init__)


def _hook_output_code() -> None:
    compiled = sys.modules["torch._inductor.output_code"].CompiledFxGraph
    compiled.__init__ = _keeping(compiled.__init__)
    compiled.__call__ = _charging(compiled.__call__)


def install() -> None:
    """In clocked mode, once dynamo is imported: price compiled graphs by their kernels (see above)."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    after_import("torch._inductor.scheduler", _hook_scheduler)
    after_import("torch._inductor.output_code", _hook_output_code)

