"""Higher-order ops (flex attention, ``torch.cond``, ``while_loop``, ``map``, ``scan``...) on the emulated tensors.

A higher-order op reaching a tensor subclass needs a rule for it ("There was no rule registered for
HOP flex_attention and subclass ..."). Run eagerly, each gets its dense one, torch's own eager path,
each op of it dispatched on the wrappers. Traced (dynamo's fake tensors, AOTAutograd's functional
ones inside the wrappers), an op runs over the host tensors inside, as every traced op does
(shim/compile/torch_compile.py), so the graph holds the op over host tensors and inductor compiles
it as for any host graph: a tracing mode's rule, which runs before a subclass's, gets the host
tensors (``torch.cond``'s fake rule merges its branches only if they are fake tensors), and flex
attention's rules, which leave subclasses to the subclass's rule, do so there. While an op runs on
the host tensors, the tensors its functions make stay on the host beside them
(:func:`on_the_host`). Flex attention also gets its autocast rule for the backend's autocast key.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import torch

_inside = threading.local()  # .depth: how many traced higher-order ops this thread runs on the host tensors


def install(tensor_type: type) -> None:
    """Give every higher-order op its dense rule for ``tensor_type``; flex attention and control flow their
    rules for traced wrappers, and the functions that trace their graphs the host tensors; flex attention its
    autocast rule."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention
    from torch.utils._python_dispatch import TorchDispatchMode

    for hop in torch._ops._higher_order_ops.values():  # flex attention's, torch.cond, while_loop, scan, ...
        dense = hop.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        if dense is None or tensor_type in hop.python_key_table:
            continue
        if hop.name() in _TRACED_ON_THE_INSIDE:
            hop.py_impl(tensor_type)(_inside_when_traced(tensor_type, hop, dense))
            continue
        hop.py_impl(tensor_type)(dense)
        if hop.name() not in _CONTROL_FLOW:
            continue
        for mode_type, handler in list(hop.python_key_table.items()):
            if isinstance(mode_type, type) and issubclass(mode_type, TorchDispatchMode):
                hop.python_key_table[mode_type] = _mode_rule_inside(tensor_type, handler)
    if DispatchKey.AutocastPrivateUse1 not in flex_attention.py_kernels:
        flex_attention.py_impl(DispatchKey.AutocastPrivateUse1)(_flex_attention_autocast)
    flex = sys.modules["torch._higher_order_ops.flex_attention"]
    flex.create_fw_bw_graph = _graphs_on_the_host(tensor_type, flex.create_fw_bw_graph)
    materialize = sys.modules["torch._higher_order_ops.utils"].materialize_as_graph
    on_host = _graphs_on_the_host(tensor_type, materialize)
    for name, module in list(sys.modules.items()):  # each op's module took the function by name
        if name.startswith("torch._higher_order_ops") and getattr(module, "materialize_as_graph", None) is materialize:
            module.materialize_as_graph = on_host


#: the higher-order ops that compile as on the GPU: traced, they run on the host tensors inside the wrappers,
#: flex attention's by their rule for the wrappers, control flow's by their tracing modes' rules
_TRACED_ON_THE_INSIDE = frozenset({"flex_attention", "flex_attention_backward"})
_CONTROL_FLOW = frozenset({"cond", "while_loop", "while_loop_stack_output", "map_impl", "scan", "associative_scan"})


def _inside_when_traced(tensor_type: type, hop, dense):
    """The rule for ``hop`` on ``tensor_type`` wrappers: traced (dynamo's fake tensors, AOTAutograd's proxies
    inside them), the op itself over the host tensors inside, so that the graph holds the op and inductor
    compiles it as it compiles any host graph; eagerly, its dense rule over the wrappers, which run the
    program's score and mask functions with the tensors they captured, wrappers too."""
    from torch.utils._pytree import tree_leaves, tree_map_only

    def rule(*args, **kwargs):
        wrappers = [a for a in tree_leaves((args, kwargs)) if isinstance(a, tensor_type)]
        if not any(_traced(w) for w in wrappers):
            return dense(*args, **kwargs)
        gpu = wrappers[0]._gpu
        inside_args, inside_kwargs = tree_map_only(tensor_type, lambda w: w._elem, (args, kwargs))
        run = hop if _host_lowers(hop, inside_args) else dense
        with on_the_host():
            out = run(*inside_args, **inside_kwargs)
        return tree_map_only(torch.Tensor, lambda t: _wrap(tensor_type, t, gpu), out)

    return rule


def _mode_rule_inside(tensor_type: type, handler):
    """A higher-order op's rule for a tracing mode (fake tensors, functionalization, the proxy that records
    the graph), which a mode runs before a subclass's rule: over traced wrappers, the same rule over the
    host tensors inside them, whose results are the wrappers' GPU's. ``torch.cond``'s fake rule, say,
    merges its branches' outputs only if they are fake tensors."""
    from torch.utils._pytree import tree_leaves, tree_map_only

    def rule(mode, *args, **kwargs):
        wrappers = [a for a in tree_leaves((args, kwargs)) if isinstance(a, tensor_type)]
        if not wrappers or not any(_traced(w) for w in wrappers):
            return handler(mode, *args, **kwargs)
        gpu = wrappers[0]._gpu
        inside_args, inside_kwargs = tree_map_only(tensor_type, lambda w: w._elem, (args, kwargs))
        with on_the_host():
            out = handler(mode, *inside_args, **inside_kwargs)
        return tree_map_only(torch.Tensor, lambda t: _wrap(tensor_type, t, gpu), out)

    return rule


def _host_lowers(hop, args: tuple) -> bool:
    """Whether inductor compiles this call of ``hop`` for the host as it is: its C++ flex attention template
    takes the forward of inference in float32, bfloat16 or float16 (no log-sum-exp, so no gradients). Else
    the op's dense math is traced in its place, and inductor compiles that: on a GPU both are one Triton
    template."""
    if hop.name() != "flex_attention":
        return False
    query, kernel_options = args[0], args[6]
    return (not kernel_options.get("OUTPUT_LOGSUMEXP", True)
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _graphs_on_the_host(tensor_type: type, make_graph):
    """A function that traces a higher-order op's functions into graphs over examples made like its
    arguments (flex attention's ``create_fw_bw_graph``, ``materialize_as_graph`` for ``torch.cond``'s and
    the others' backward): traced, over the host tensors inside the wrappers, as the op itself then runs.
    A fake tensor made on the emulated device instead would take the autograd engine to a device stream
    that a fake tensor has none of."""
    from torch.utils._pytree import tree_leaves, tree_map_only

    def make(*args, **kwargs):
        if not any(_traced(w) for w in tree_leaves((args, kwargs)) if isinstance(w, tensor_type)):
            return make_graph(*args, **kwargs)
        args, kwargs = tree_map_only(tensor_type, _inside, (args, kwargs))
        with on_the_host():
            return make_graph(*args, **kwargs)

    return make


def _traced(w: torch.Tensor) -> bool:
    """Whether the wrapper ``w`` is being traced: a fake (dynamo) or functional (AOTAutograd) tensor inside."""
    return type(w._elem) is not torch.Tensor


def _inside(w: torch.Tensor) -> torch.Tensor:
    """The host tensor inside the wrapper ``w``, with its ``requires_grad``."""
    return w._elem.detach().requires_grad_(w.requires_grad) if w.requires_grad else w._elem


def _wrap(tensor_type: type, t: torch.Tensor, gpu: int) -> torch.Tensor:
    """The host tensor ``t`` an op made on the host tensors inside ``tensor_type`` wrappers, as GPU ``gpu``'s."""
    return t if isinstance(t, tensor_type) else tensor_type.__tensor_unflatten__({"_elem": t}, gpu, None, None)


def on_host_now() -> bool:
    """Whether this thread runs a traced higher-order op on the host tensors (:func:`on_the_host`)."""
    return bool(getattr(_inside, "depth", 0))


@contextmanager
def on_the_host():
    """While a traced higher-order op runs on the host tensors inside the emulated ones, the tensors its
    functions make stay on the host beside them: their factories naming a GPU, and the emulated tensors a
    compiled region makes (shim/compile/torch_compile.py's ``on_gpu``)."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        with _HostFactories():
            yield
    finally:
        _inside.depth -= 1


class _HostFactories(torch.overrides.TorchFunctionMode):
    """Factories naming a GPU make host tensors: a score or mask function dynamo traced over emulated
    examples (``b.new_ones(..., device=cuda:0)``) runs on host tensors. A mode of its own, as dynamo
    lifts CudaMode (shim/cuda/mode.py) off the stack while it propagates fake tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = kwargs.get("device")
        if d is not None and _names_a_gpu(d):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _names_a_gpu(d) -> bool:
    """Whether a factory's ``device=`` names a GPU (an index does, as in torch)."""
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True
    return torch.device(d).type in ("cuda", torch._C._get_privateuse1_backend_name())


def _flex_attention_autocast(query, key, value, *args):
    """flex attention under cuda autocast, as its AutocastCUDA rule: query, key and value in the autocast dtype."""
    from torch._higher_order_ops.flex_attention import flex_attention

    from shim.device.autocast import cast_lower, excluded

    query, key, value = cast_lower((query, key, value))
    with excluded():
        return flex_attention(query, key, value, *args)
