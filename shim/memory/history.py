"""``torch.cuda.memory``'s history and snapshots, from the allocator model (``shim/memory/allocator.py``).

PyTorch's tool for seeing where GPU memory goes: ``_record_memory_history()``
starts recording every allocation and free with the Python stack that made
it, ``_snapshot()`` / ``_dump_snapshot()`` give the live allocations and that
trace in the dictionary ``torch.cuda._memory_viz`` and pytorch.org/memory_viz
read. A CPU build has no entry points for them (``AttributeError``), so
programs that take snapshots (torchtitan's ``enable_memory_snapshot``) failed.

What the model can say, it says as the caching allocator would: each block's
size rounded to 512 bytes and its requested size, its Python stack, the
allocations and frees in order with their times, and an ``oom`` entry where
the allocator raised. What it cannot: addresses are the host storage's (real
and unique while it lives, not a GPU's), each live block is shown as a
segment of its own (the model reserves memory in 2 MiB units but keeps no
segment layout, so no ``segment_alloc``/``segment_free`` entries and no
fragmentation), and frees carry no stack (they are applied where the
allocator next looks, not where the tensor died).
"""

from __future__ import annotations

import collections
import sys
import time

#: what ``enabled`` may be (``None`` stops recording), and ``context``, as torch checks them
_ENABLED = (None, "state", "all")
_CONTEXT = (None, "state", "alloc", "all")
#: frames of these files are the emulation's, not the program's: left out of stacks
_OURS = ("/shim/",)


def _frames() -> list[dict]:
    """The calling Python stack as the allocator records it: innermost first, mirage's own frames left out."""
    out = []
    f = sys._getframe(1)
    while f is not None:
        filename = f.f_code.co_filename
        if not any(part in filename for part in _OURS):
            out.append({"filename": filename, "line": f.f_lineno, "name": f.f_code.co_name})
        f = f.f_back
    return out


class History:
    """The recording ``_record_memory_history`` started: a trace per GPU and each live block's stack."""

    def __init__(self, devices: int, enabled: str, context: str | None, max_entries: int):
        self.enabled = enabled  # "state": stacks of live blocks only; "all": the trace too
        self.context = context  # "alloc"/"all"/"state": record stacks; None: none
        self.traces = [collections.deque(maxlen=max_entries if max_entries < sys.maxsize else None)
                       for _ in range(devices)]
        self.frames: dict[int, list[dict]] = {}  # a live block's key -> where it was allocated
        self.requested: dict[int, int] = {}  # a live block's key -> the bytes its storage asked for

    def configure(self, enabled: str, context: str | None, max_entries: int, clear: bool) -> None:
        """Record again with new settings; the trace so far is kept (up to ``max_entries``) unless ``clear``."""
        self.enabled, self.context = enabled, context
        maxlen = max_entries if max_entries < sys.maxsize else None
        self.traces = [collections.deque(() if clear else t, maxlen=maxlen) for t in self.traces]
        if clear:
            self.frames.clear()
            self.requested.clear()

    def _entry(self, gpu: int, action: str, **fields) -> None:
        if self.enabled == "all":
            self.traces[gpu].append({"action": action, "stream": 0, "time_us": time.time_ns() // 1000, **fields})

    def alloc(self, gpu: int, key: int, size: int, requested: int) -> None:
        """A block of ``size`` bytes (``requested`` before rounding) was allocated on ``gpu`` at ``key``."""
        frames = _frames() if self.context else []
        self.frames[key] = frames
        self.requested[key] = requested
        self._entry(gpu, "alloc", addr=key, size=size, frames=frames)

    def free(self, gpu: int, key: int, size: int) -> None:
        """The block at ``key`` was freed: requested and completed at once (nothing waits on another stream)."""
        self.frames.pop(key, None)
        self.requested.pop(key, None)
        self._entry(gpu, "free_requested", addr=key, size=size, frames=[])
        self._entry(gpu, "free_completed", addr=key, size=size, frames=[])

    def oom(self, gpu: int, size: int, device_free: int) -> None:
        """The allocator raised OutOfMemoryError for ``size`` bytes."""
        self._entry(gpu, "oom", size=size, device_free=device_free,
                    frames=_frames() if self.context else [])


def snapshot(live: dict[int, list], history: History | None, devices: int) -> dict:
    """The dictionary ``torch.cuda.memory._snapshot()`` returns, from the allocator's live blocks.

    ``live`` maps a block's key to ``[gpu, rounded size, pool, holders]`` (``Allocator._live``); a block
    allocated while nothing recorded has no stack, and its requested size is its rounded one.
    """
    frames = history.frames if history is not None else {}
    requested = history.requested if history is not None else {}
    segments = []
    for key, (gpu, size, pool, _) in sorted(live.items(), key=lambda kv: (kv[1][0], kv[0])):
        block = {"address": key, "size": size, "requested_size": requested.get(key, size),
                 "state": "active_allocated", "frames": frames.get(key, [])}
        segments.append({"device": gpu, "address": key, "total_size": size, "allocated_size": size,
                         "active_size": size, "requested_size": block["requested_size"], "stream": 0,
                         "segment_type": "large" if pool else "small", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": block["frames"], "blocks": [block]})
    traces = [list(t) for t in history.traces] if history is not None else [[] for _ in range(devices)]
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0, "expandable_segments": False,
                                   "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
                                   "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {}}}


def check(enabled, context) -> None:
    """A ValueError naming a setting torch does not take."""
    if enabled not in _ENABLED:
        raise ValueError(f"_record_memory_history: enabled must be one of {list(_ENABLED)}, not {enabled!r}")
    if context not in _CONTEXT:
        raise ValueError(f"_record_memory_history: context must be one of {list(_CONTEXT)}, not {context!r}")
