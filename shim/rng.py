"""Random numbers on the emulated GPUs: one generator per device, as on a GPU build.

``torch.cuda.default_generators`` holds one CPU generator per emulated GPU, so
``torch.cuda.manual_seed``/``get_rng_state``/``fork_rng`` (torch's own code,
unchanged) act on them, seeding a GPU leaves the CPU stream alone, and a
random op on ``cuda:i`` with no explicit generator draws from device i's —
reproducible per seed. ``torch.Generator(device="cuda")`` works too.
"""

from __future__ import annotations

import torch

from shim import device as dev

NO_GENERATOR = -1
#: op -> position of its ``generator`` argument (NO_GENERATOR: it takes none), filled as ops are seen
GENERATOR_ARG: dict = {}


def _make_default_generators() -> tuple[torch.Generator, ...]:
    return tuple(torch._C.Generator() for _ in range(max(dev.STATE.count, 1)))


DEFAULT_GENERATORS = _make_default_generators()


def _generator_arg(func) -> int:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "generator":
            return i
    return NO_GENERATOR


def supply_generator(func, args: tuple, kwargs: dict, gpu: int) -> tuple[tuple, dict]:
    """Give a random op with no generator of its own device ``gpu``'s default generator."""
    pos = GENERATOR_ARG.get(func)
    if pos is None:
        pos = GENERATOR_ARG[func] = _generator_arg(func)
    if pos == NO_GENERATOR or kwargs.get("generator") is not None:
        return args, kwargs
    if pos < len(args):
        if args[pos] is not None:
            return args, kwargs
        args = args[:pos] + (DEFAULT_GENERATORS[gpu],) + args[pos + 1 :]
        return args, kwargs
    return args, dict(kwargs, generator=DEFAULT_GENERATORS[gpu])


def native_dropout(x: torch.Tensor, p: float, train: bool | None, gpu: int):
    """``aten.native_dropout`` drawing its mask from ``gpu``'s generator (the CPU kernel takes none)."""
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p == 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p, generator=DEFAULT_GENERATORS[gpu])
    return x * mask * (1.0 / (1 - p)), mask


class _GeneratorType(type(torch._C.Generator)):
    # torch.Generator() still returns a plain generator; isinstance must accept those too
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """``torch.Generator``, which also accepts ``device="cuda[:i]"``."""

    _gpu: int

    def __new__(cls, device="cpu"):
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type not in ("cuda", dev.BACKEND):
            return torch._C.Generator(d)
        g = super().__new__(cls, "cpu")
        g._gpu = dev.check_index(dev.STATE.current if d.index is None else d.index)
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._gpu)


def install() -> None:
    """Expose the per-device generators where torch.cuda's own random functions look for them."""
    torch.cuda.default_generators = DEFAULT_GENERATORS
    r = torch.cuda.random
    # torch.cuda.random bound these names at import; it must see the emulated answers
    r._lazy_init = dev.initialize
    r.is_initialized = lambda: dev.STATE.initialized
    r.current_device = lambda: dev.STATE.current
    r.device_count = lambda: dev.STATE.count
    torch.Generator = Generator
