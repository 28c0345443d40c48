"""Clocked mode's costs of the ops it has priced, found again by each op's full signature (issue #30).

A training step runs the same ops on the same shapes step after step, and
:func:`shim.clock.roofline.op_cost` works each cost out afresh from the
tensors' metadata. :class:`OpCosts` keeps each cost under its op's
*signature*: the op; every tensor's type, layout, dtype, sizes and strides;
which arguments are one and the same tensor (``x + x`` reads ``x`` once, an
in-place op writes its input); and every other argument's type and value. Two
calls share a cost only when their signatures are equal as a whole, and then
``op_cost`` reads the same from both; a call with an argument of another kind
(a generator, an object of the program's) is priced afresh every time.

An op priced by the bytes it moves alone (no FLOP formula, not attention:
``op_cost`` reads only its tensors) keeps its other arguments' types but not
their values: Adam's ``_foreach_div_`` and ``_foreach_addcdiv_`` take this
step's bias corrections, new numbers every step, and would otherwise be priced
afresh every step.

The signature is built in C++ once the fast dispatch library is loaded
(``signature()`` in ``shim/native/fast_dispatch.cpp``: ~1.3 µs an op, against
~5.6 µs here for the same keys); :func:`python_signature` serves where it is
not. The fast dispatch keeps its own table, keyed the same way with the
argument values, for the ops it runs in C++.

Tensor metadata is read with torch's function modes off: the shim's
``CudaMode`` would otherwise run Python for every ``stride()`` and ``shape``.
"""

from __future__ import annotations

import torch

from shim.clock.roofline import OpCost, op_cost, values_matter
from wire.profiles import Profile

#: a program whose shapes never repeat starts the table afresh past this many signatures
MAX_COSTS = 1 << 16

# Markers in a signature; each is followed by a fixed number of items, and where a marker stands
# an argument's value stands after its type (never an int), so no two calls of different arguments
# flatten alike.
_NEW = 1  # a tensor not seen before in this call: type, layout, dtype, sizes, strides
_SAME = 2  # a tensor seen before in this call: the order of its first appearance
_LIST = 3  # a list: its length, then its items
_TUPLE = 4  # a tuple: its length, then its items
_KWARGS = 5  # the keyword arguments: a tuple of their names, then their values
_OUT = 6  # what the op returned

#: the types of the other arguments a signature holds by value (each compared with its type, so
#: ``2`` and ``2.0`` and ``True`` stay apart); an argument of any other type is not cached
_VALUE_TYPES = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format})
_STRIDED = torch.strided


class _Unsigned(Exception):
    """An argument a signature cannot hold: the call is priced afresh."""


def _add(key: list, values, seen: dict[int, int], by_value: bool) -> None:
    """Append each of ``values`` (arguments, lists or tuples of them, an op's results) to the signature ``key``;
    an argument other than a tensor, list or tuple by its type and value, or (``by_value`` false: an op priced
    by its bytes, whose cost depends on no such value) by its type alone."""
    for value in values:
        if isinstance(value, torch.Tensor):
            first = seen.get(id(value))
            if first is not None:
                key += (_SAME, first)
                continue
            seen[id(value)] = len(seen)
            layout = value.layout
            key += (_NEW, type(value), layout, value.dtype, value.shape,
                    value.stride() if layout is _STRIDED else None)
        elif isinstance(value, (list, tuple)):
            key += (_LIST if isinstance(value, list) else _TUPLE, len(value))
            _add(key, value, seen, by_value)
        elif not by_value:
            key.append(type(value))
        elif type(value) in _VALUE_TYPES:
            key += (type(value), value)
        else:
            raise _Unsigned


#: the same signature built in C++ (``signature(values, func, args, kwargs, out) -> bytes | None``,
#: shim/native/fast_dispatch.cpp), once shim/tensor/fast_dispatch.py has loaded it; None: Python's
_native_signature = None


def use_native_signature(native) -> None:
    """Key the costs with ``native`` (the C++ signature, about a tenth of Python's cost) from now on."""
    global _native_signature
    _native_signature = native


def signature(func, args, kwargs, out) -> tuple | bytes | None:
    """The full signature of the call ``func(*args, **kwargs) -> out`` (torch's function modes off), or
    None when an argument is of a kind it cannot hold: C++'s where loaded, else :func:`python_signature`."""
    if _native_signature is not None:
        return _native_signature(values_matter(func), func, tuple(args), kwargs, out)
    return python_signature(func, args, kwargs, out)


def python_signature(func, args, kwargs, out) -> tuple | None:
    """:func:`signature` in Python."""
    key: list = [id(func)]  # the table keeps func (its id stays its own); OpOverload.__hash__ is Python
    seen: dict[int, int] = {}  # id of each tensor -> the order it first appeared in
    by_value = values_matter(func)
    try:
        _add(key, args, seen, by_value)
        if kwargs:
            key += (_KWARGS, tuple(kwargs))  # the names, then the values in their order
            _add(key, kwargs.values(), seen, by_value)
        key.append(_OUT)
        _add(key, (out,), seen, by_value)
    except _Unsigned:
        return None
    return tuple(key)


class OpCosts:
    """The costs :func:`~shim.clock.roofline.op_cost` gave on ``profile``'s GPU, by signature."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._costs: dict[tuple, tuple] = {}  # signature -> (the op, its cost)
        self.hits = 0
        self.misses = 0

    def cost(self, func, args, kwargs, out) -> OpCost:
        """The cost of the call ``func(*args, **kwargs) -> out``, as ``op_cost`` gives it (torch's function
        modes off: called from :meth:`shim.clock.clock.Clock.charge`)."""
        key = signature(func, args, kwargs, out)
        if key is None:
            self.misses += 1
            return op_cost(func, args, kwargs, out, self.profile)
        entry = self._costs.get(key)
        if entry is not None:
            self.hits += 1
            return entry[1]
        self.misses += 1
        if len(self._costs) >= MAX_COSTS:
            self._costs.clear()
        cost = op_cost(func, args, kwargs, out, self.profile)
        self._costs[key] = (func, cost)
        return cost
