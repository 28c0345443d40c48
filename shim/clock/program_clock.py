"""The program's own clock: ``--program-clock emulated`` (issue #30).

In a clocked run with ``MIRAGE_PROGRAM_CLOCK=emulated``, a rank's
``time.perf_counter``, ``time.monotonic``, ``time.time`` (and their ``_ns``
forms) read the rank's emulated time, so what a program prints from its own
clock (tokens/s, MFU, samples/s, a step timed around ``torch.cuda.synchronize()``)
is the prediction, as it would print it on the cluster.

What "now" is: the emulated host is infinitely fast and waits only where it
synchronises (``shim.clock.clock``), so the program's now is the host's
position, ``Clock.host``; ``torch.cuda.synchronize()`` moves it to the end of
the device's streams, as on a GPU. On top of it, per thread:

- ``time.sleep(s)`` really sleeps and moves the calling thread's reading on by
  ``s`` (a loop that sleeps until a deadline on the program's clock ends); it
  does not delay the kernels the host issues, so the prediction is the same
  with either ``--program-clock``;
- every read is at least 1 ns after the thread's previous one, so an interval
  is never 0 (a rate divided by it stays finite).

``time.time()`` is the wall time at install plus the emulated time elapsed;
``perf_counter`` and ``monotonic`` likewise start from their real readings.

What stays wall time: a call made from the modules of :data:`WALL_MODULES`
(the shim and the rest of mirage, the standard library's waiting and
concurrency, ``torch.distributed``, DataLoader, the compiler, ZeroMQ) reads
the real clock, whatever way it reached the function (``time.monotonic()``,
or ``from time import monotonic`` at its import, before or after this one):
their timeouts and watchdogs measure real waits and must end. The caller is
told by its frame's module. Not patched at all: ``time.process_time``,
``thread_time``, ``clock_gettime``, ``datetime.now()``, C-level timeouts
(sockets, the c10d store, ZeroMQ polls).

Only the rank processes install it (``shim.bootstrap``, or ``shim.comm.world`` when a descendant claims a
rank); a fork's child gets the real functions back until it claims a rank of its own. Only the standard
library here: it is installed before the program imports torch.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from types import MappingProxyType

from shim.rank.runtime import RUNTIME

#: the real functions, captured before anything is patched; the shim's own waits may use them directly
perf_counter = time.perf_counter
perf_counter_ns = time.perf_counter_ns
monotonic = time.monotonic
monotonic_ns = time.monotonic_ns
wall_time = time.time
wall_time_ns = time.time_ns
sleep = time.sleep

#: callers from these modules (and their submodules) read the real clocks: their waits and timeouts are real
WALL_MODULES = (
    # mirage itself: the daemon client's waits, the transports' watchdog, hang machinery, fault delays
    "shim", "wire", "emulator", "mirage_tui", "sitecustomize",
    # the standard library's waits: Condition/Event/Lock timeouts, queues, processes, event loops, selectors
    "threading", "queue", "subprocess", "selectors", "asyncio", "concurrent", "multiprocessing", "sched",
    "socket", "socketserver", "ssl", "http", "urllib", "_strptime",
    # torch's own machinery: store and barrier timeouts, elastic, DataLoader workers, compile workers
    "torch.distributed", "torch.multiprocessing", "torch.utils.data", "torch._inductor", "torch._dynamo",
    "torch.utils._triton", "triton",
    # ZeroMQ's Python side (its polls are C-level, on their own clock); the debuggers --debug-rank waits for
    "zmq", "debugpy", "pydevd", "_pydevd_bundle", "_pydev_bundle",
)

_NS = 1e-9
_installed = False
_base: tuple[float, float, float, int, int, int] = (0.0, 0.0, 0.0, 0, 0, 0)
_wall_callers: dict[str, bool] = {}
_threads = threading.local()  # .floor: the thread's reading after its last sleep; .last: its last reading


def _is_wall(module: str) -> bool:
    wall = _wall_callers.get(module)
    if wall is None:
        wall = _wall_callers[module] = any(module == m or module.startswith(m + ".") for m in WALL_MODULES)
    return wall


def _caller_is_wall() -> bool:
    """Whether the function that called the patched clock belongs to a module that keeps wall time (a call with
    no Python caller, from C, does), or the clock is not installed (a fork's child still holding the patched
    functions under names it bound with ``from time import ...``)."""
    if not _installed:
        return True
    try:
        caller = sys._getframe(2)
    except ValueError:
        return True
    return _is_wall(caller.f_globals.get("__name__") or "")


def elapsed() -> float:
    """The calling thread's program time: emulated seconds since the clock was installed."""
    clock = RUNTIME.clock
    t = clock.host if clock is not None else 0.0
    local = _threads.__dict__
    floor = local.get("floor", 0.0)
    if floor > t:
        t = floor
    last = local.get("last")
    if last is not None and t <= last:
        t = last + _NS
    local["last"] = t
    return t


def _strictly_after(key: str, value):
    """``value``, or the next one after the thread's last reading of clock ``key`` when it is not later: a
    1 ns step vanishes when added to a base such as ``time.time()``'s (one float step there is ~0.2 us)."""
    local = _threads.__dict__
    last = local.get(key)
    if last is not None and value <= last:
        value = math.nextafter(last, math.inf) if isinstance(value, float) else last + 1
    local[key] = value
    return value


def _emulated(name: str, real, base: int, ns: bool):
    """``time.<name>`` for the program: ``real()`` when a wall-time module calls it, else the reading of
    ``_base[base]`` plus the thread's program time (in integer nanoseconds for an ``_ns`` clock)."""

    def read():
        if _caller_is_wall():
            return real()
        e = elapsed()
        return _strictly_after(name, _base[base] + (round(e * 1e9) if ns else e))

    read.__name__ = read.__qualname__ = name
    return read


def _sleep(seconds: float) -> None:
    sleep(seconds)  # a TypeError or ValueError for a bad argument, as time.sleep raises
    if not _caller_is_wall() and seconds > 0:
        local = _threads.__dict__
        local["floor"] = max(local.get("floor", 0.0), local.get("last") or 0.0) + seconds


_REAL = MappingProxyType({"perf_counter": perf_counter, "monotonic": monotonic, "time": wall_time,
                          "perf_counter_ns": perf_counter_ns, "monotonic_ns": monotonic_ns, "time_ns": wall_time_ns,
                          "sleep": sleep})
#: each clock with its real function and its place in ``_base`` (install's order)
_PATCHES = MappingProxyType({
    **{name: _emulated(name, _REAL[name], i, name.endswith("_ns"))
       for i, name in enumerate(("perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns"))},
    "sleep": _sleep,
})


def install() -> None:
    """Make the ``time`` module's clocks follow the rank's emulated time (clocked mode with
    ``MIRAGE_PROGRAM_CLOCK=emulated``); nothing otherwise, and nothing the second time."""
    global _installed, _base, _threads
    settings = RUNTIME.settings
    if _installed or not (settings.clocked and settings.program_clock == "emulated"):
        return
    _installed = True
    _threads = threading.local()  # every thread starts afresh, not only this one
    _base = (perf_counter(), monotonic(), wall_time(), perf_counter_ns(), monotonic_ns(), wall_time_ns())
    for name, fn in _PATCHES.items():
        setattr(time, name, fn)


def uninstall() -> None:
    """The real clocks again (a fork's child, until it claims a rank)."""
    global _installed
    if not _installed:
        return
    _installed = False
    for name, fn in _REAL.items():
        setattr(time, name, fn)


os.register_at_fork(after_in_child=uninstall)
