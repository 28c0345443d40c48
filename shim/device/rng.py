"""Random numbers on the emulated GPUs: one generator per device, with a GPU generator's (seed, offset) state.

``torch.cuda.default_generators`` holds one :class:`DeviceGenerator` per
emulated GPU, so ``torch.cuda.manual_seed``/``get_rng_state``/``fork_rng``
(torch's own code, unchanged) act on them, seeding a GPU leaves the CPU stream
alone, and a random op on ``cuda:i`` with no explicit generator draws from
device i's — reproducible per seed. ``torch.Generator(device="cuda")`` makes
another one.

The state is what CUDA's and HIP's Philox generator keeps, 16 bytes: a seed
and an offset that every draw advances. DTensor's random ops
(``torch.distributed.tensor._random.OffsetBasedRNGTracker``: ``reset_parameters``
on FSDP2/TP-sharded parameters, dropout on DTensors) rewrite the offset in
those bytes to give every shard its own part of the stream and to leave every
rank at the same offset afterwards, so the state must be those 16 bytes alone.
Like Philox, the numbers are a function of (seed, offset): each draw runs the
CPU's kernel on an engine seeded from the two. Only the first draw after
seeding (offset 0) gives the values the CPU's generator gives for that seed;
later ones differ from the CPU's stream (and from a real GPU's).
"""

from __future__ import annotations

import struct
import threading

import torch

from shim.device import state as dev
from shim.rank.runtime import RUNTIME

NO_GENERATOR = -1
#: op -> position of its ``generator`` argument (NO_GENERATOR: it takes none), filled as ops are seen
GENERATOR_ARG: dict = {}

#: the seed of a generator nobody seeded (c10's default_rng_seed_val, on GPUs and the CPU alike)
DEFAULT_SEED = 67280421310721
#: a state: seed (uint64) and offset (int64), little-endian, as torch.cuda.get_rng_state() returns it
_STATE = struct.Struct("<Qq")
_MASK64 = (1 << 64) - 1


def _engine_seed(seed: int, offset: int) -> int:
    """The engine's seed for the values at ``offset`` of ``seed``'s stream.

    At offset 0 (right after ``manual_seed``) the seed itself, so the first draw
    after seeding is the CPU's for that seed (OpInfo's seeded random samples
    compare equal); elsewhere splitmix64's finaliser of the two, folded to 32
    bits: the CPU engine (mt19937) keeps only the low 32 bits of its seed.
    """
    if offset == 0:
        return seed
    z = (seed ^ (offset * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


class DeviceGenerator(torch._C.Generator):
    """The generator of emulated GPU ``gpu``: a (seed, offset) state over a CPU engine.

    It is a real ``torch.Generator``, so random ops accept it and the CPU
    kernels draw from its engine, which :meth:`engine` seeds from the state
    before every draw; the Python methods below keep the seed and offset a
    GPU generator reports.
    """

    _gpu: int
    _seed: int
    _offset: int

    def __new__(cls, gpu: int):
        g = super().__new__(cls, "cpu")
        g._gpu = gpu
        g._seed = DEFAULT_SEED
        g._offset = 0
        # a draw is seed-engine, run the kernel, advance: one at a time, as a GPU generator's mutex makes it
        g.lock = threading.RLock()
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._gpu)

    def manual_seed(self, seed) -> DeviceGenerator:  # type: ignore[override]
        super().manual_seed(seed)  # torch's own range check and wrapping of negative seeds
        self._seed = super().initial_seed()
        self._offset = 0
        return self

    def seed(self) -> int:  # type: ignore[override]
        self._seed = super().seed()
        self._offset = 0
        return self._seed

    def initial_seed(self) -> int:  # type: ignore[override]
        return self._seed

    def get_offset(self) -> int:  # type: ignore[override]
        return self._offset

    def set_offset(self, offset: int) -> None:  # type: ignore[override]
        self._offset = offset

    def get_state(self) -> torch.Tensor:  # type: ignore[override]
        return torch.frombuffer(bytearray(_STATE.pack(self._seed, self._offset)), dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> DeviceGenerator:  # type: ignore[override]
        state = state.detach().to("cpu")
        if state.dtype != torch.uint8 or state.numel() != _STATE.size:
            raise RuntimeError(
                f"RNG state must be a torch.ByteTensor of {_STATE.size} bytes (seed and offset, what "
                f"torch.cuda.get_rng_state() returns), got {state.dtype} with {state.numel()} elements"
            )
        self._seed, self._offset = _STATE.unpack(state.numpy().tobytes())
        return self

    def engine(self) -> DeviceGenerator:
        """Seed the engine for a draw at the current (seed, offset); the kernel then draws from ``self``."""
        super().manual_seed(_engine_seed(self._seed, self._offset))
        return self

    def advance(self, numel: int) -> None:
        """Count a draw of ``numel`` values, as a GPU generator's offset counts them (in multiples of 4)."""
        self._offset += (numel + 3) // 4 * 4


def _make_default_generators(runtime) -> None:
    runtime.device.generators = tuple(DeviceGenerator(i) for i in range(max(runtime.device.count, 1)))


RUNTIME.attach(_make_default_generators)


def _generator_arg(func) -> int:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "generator":
            return i
    return NO_GENERATOR


_RANDOM_OVERLOAD: dict = {}  # op -> the overload that takes a generator (itself, a sibling, or None)


def random_overload(func):
    """``func`` if it takes a generator; else its sibling overload that does (``randn_like`` ->
    ``randn_like.generator``), which the CPU kernel would otherwise skip for the CPU's generator;
    None for an op that draws nothing."""
    if func in _RANDOM_OVERLOAD:
        return _RANDOM_OVERLOAD[func]
    found = None
    if _generator_arg(func) != NO_GENERATOR:
        found = func
    elif hasattr(func, "_overloadpacket"):
        own = [(a.name, str(a.type)) for a in func._schema.arguments]
        for name in func._overloadpacket.overloads():
            other = getattr(func._overloadpacket, name)
            args = [(a.name, str(a.type)) for a in other._schema.arguments]
            if _generator_arg(other) != NO_GENERATOR and [a for a in args if a[0] != "generator"] == own:
                found = other
                break
    _RANDOM_OVERLOAD[func] = found
    return found


def _numel(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, (list, tuple)):
        return sum(_numel(o) for o in out)
    return 0


def call_random(func, args: tuple, kwargs: dict, gpu: int):
    """Run ``func`` (a random op, or one not seen yet) on host tensors, drawing from ``gpu``'s generator.

    The op's own generator, if it was given one, is used instead; an emulated
    GPU's generator then counts the values drawn in its offset.
    """
    func = random_overload(func) or func
    pos = GENERATOR_ARG.get(func)
    if pos is None:
        pos = GENERATOR_ARG[func] = _generator_arg(func)
    if pos == NO_GENERATOR:
        return func(*args, **kwargs)
    g = kwargs.get("generator") if pos >= len(args) else args[pos]
    if g is None:
        g = RUNTIME.device.generators[gpu]
        if pos < len(args):
            args = args[:pos] + (g,) + args[pos + 1 :]
        else:
            kwargs = dict(kwargs, generator=g)
    if not isinstance(g, DeviceGenerator):
        return func(*args, **kwargs)
    with g.lock:
        g.engine()
        out = func(*args, **kwargs)
        g.advance(_numel(out))
    return out


def native_dropout(x: torch.Tensor, p: float, train: bool | None, gpu: int):
    """``aten.native_dropout`` drawing its mask from ``gpu``'s generator (the CPU kernel takes none)."""
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p == 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    # The mask is drawn in x's dtype where it is floating point: the same draws as into a bool tensor (the
    # CPU kernel takes one per element whatever the dtype), and x * noise then needs no bool-to-float copy.
    floating = x.is_floating_point()
    g = RUNTIME.device.generators[gpu]
    with g.lock:
        noise = torch.empty_like(x, dtype=x.dtype if floating else torch.bool).bernoulli_(1 - p, generator=g.engine())
        g.advance(noise.numel())
    out = x * noise
    return out.mul_(1.0 / (1 - p)) if floating else out * (1.0 / (1 - p)), noise.bool()


class _GeneratorType(type(torch._C.Generator)):
    # torch.Generator() still returns a plain generator; isinstance must accept those too
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """``torch.Generator``, which also accepts ``device="cuda[:i]"`` (a :class:`DeviceGenerator`)."""

    def __new__(cls, device="cpu"):
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type not in ("cuda", dev.BACKEND):
            return torch._C.Generator(d)
        return DeviceGenerator(dev.check_index(RUNTIME.device.current if d.index is None else d.index))


def install() -> None:
    """Expose the per-device generators where torch.cuda's own random functions look for them."""
    torch.cuda.default_generators = RUNTIME.device.generators
    r = torch.cuda.random
    # torch.cuda.random bound these names at import; it must see the emulated answers
    r._lazy_init = dev.initialize
    r.is_initialized = lambda: RUNTIME.device.initialized
    r.current_device = lambda: RUNTIME.device.current
    r.device_count = lambda: RUNTIME.device.count
    torch.Generator = Generator
