"""Higher-order ops (flex attention, ``torch.cond``, ``map``, ``scan``...) on the emulated tensors.

A higher-order op reaching a tensor subclass needs a rule for it ("There was no rule registered for
HOP flex_attention and subclass ..."): its dense one, torch's own eager path, each op of it
dispatched on the wrappers. Their eager paths compile their own calls (``backend="eager"``), which
dynamo cannot do over emulated tensors, so those calls run as they are. Flex attention also gets
its autocast rule for the backend's autocast key.
"""

from __future__ import annotations

import sys

import torch

from shim.import_hooks import after_import


def install(tensor_type: type) -> None:
    """Give every higher-order op its dense rule for ``tensor_type``, and flex attention its autocast rule."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention

    for hop in torch._ops._higher_order_ops.values():  # flex attention's, torch.cond, while_loop, scan, ...
        dense = hop.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        if dense is not None and tensor_type not in hop.python_key_table:
            hop.py_impl(tensor_type)(dense)
    if DispatchKey.AutocastPrivateUse1 not in flex_attention.py_kernels:
        flex_attention.py_impl(DispatchKey.AutocastPrivateUse1)(_flex_attention_autocast)
    after_import("torch.nn.attention.flex_attention", _flex_attention_eager)
    hop_utils = sys.modules["torch._higher_order_ops.utils"]
    hop_utils._hop_compile_and_call = _hop_call_on(tensor_type, hop_utils._hop_compile_and_call)


def _flex_attention_eager() -> None:
    """``flex_attention`` as a function of this module, which dynamo skips (shim/compile/torch_compile.py).

    Dynamo cannot trace the flex attention op over emulated tensors yet (its autograd
    rule takes only plain fake tensors). So under ``torch.compile`` a call to it is a
    graph break, as ``TORCH_LOGS=graph_breaks`` says, and it runs eagerly, its unfused
    implementation, which itself compiles its call of the op (``backend="eager"``, to
    trace the score and mask functions): the op is called as it is there, no frame
    under it compiled. Replaced as the module is imported, before a program takes the
    name from it.
    """
    module = sys.modules["torch.nn.attention.flex_attention"]
    dense = module.flex_attention

    def flex_attention(*args, **kwargs):
        compile_ = torch.compile
        torch.compile = _not_compiled
        try:
            return _no_frame_compiled(dense, args, kwargs)
        finally:
            torch.compile = compile_

    flex_attention.__doc__, flex_attention.__qualname__ = dense.__doc__, dense.__qualname__
    module.flex_attention = flex_attention


def _hop_call_on(tensor_type, compile_and_call):
    """``_hop_compile_and_call``: how ``torch.cond``, ``map``, ``scan``... run eagerly: torch compiles the op's
    call (``backend="eager"``, ``fullgraph``) to trace its functions; over emulated tensors dynamo cannot
    (the op's rule for them is its dense one, which branches on their values), so the op is called as it is,
    no frame under it compiled."""
    from torch.utils._pytree import tree_leaves

    def call(fn, args, kwargs=None):
        if not any(isinstance(a, tensor_type) for a in tree_leaves((args, kwargs))):
            return compile_and_call(fn, args, kwargs)
        return _no_frame_compiled(fn, args, kwargs or {})

    return call


def _no_frame_compiled(fn, args, kwargs):
    """``fn(*args, **kwargs)`` with dynamo's frame callback off, as under ``torch.compiler.disable``."""
    from torch._C._dynamo.eval_frame import set_eval_frame

    prior = set_eval_frame(None)
    try:
        return fn(*args, **kwargs)
    finally:
        set_eval_frame(prior)


def _not_compiled(fn, **_options):
    """``torch.compile`` inside flex attention's unfused path: the function itself."""
    return fn


def _flex_attention_autocast(query, key, value, *args):
    """flex attention under cuda autocast, as its AutocastCUDA rule: query, key and value in the autocast dtype."""
    from torch._higher_order_ops.flex_attention import flex_attention

    from shim.device.autocast import cast_lower, excluded

    query, key, value = cast_lower((query, key, value))
    with excluded():
        return flex_attention(query, key, value, *args)
