"""``torch.cuda.memory``'s history and snapshots, from the allocator model (``shim/memory/allocator.py``).

PyTorch's tool for seeing where GPU memory goes: ``_record_memory_history()``
starts recording every allocation and free with the Python stack that made
it, ``_snapshot()`` / ``_dump_snapshot()`` give the live allocations and that
trace in the dictionary ``torch.cuda._memory_viz`` and pytorch.org/memory_viz
read. A CPU build has no entry points for them (``AttributeError``), so
programs that take snapshots (torchtitan's ``enable_memory_snapshot``) failed.

What the model can say, it says as the caching allocator would: its segments
and the blocks they are split into (``shim/memory/blocks.py``; addresses are
the model's virtual ones), each block's size rounded to 512 bytes and its
requested size, its Python stack, the allocations, frees, ``segment_alloc``
and ``segment_free`` in order with their times and streams, and an ``oom``
entry where the allocator raised. What it cannot: frees carry no stack (they
are applied where the allocator next looks, not where the tensor died).
"""

from __future__ import annotations

import collections
import sys
import time

from shim.memory.blocks import Block, DeviceMemory

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
        self.frames: dict[int, list[dict]] = {}  # a live block's address -> where it was allocated

    def configure(self, enabled: str, context: str | None, max_entries: int, clear: bool) -> None:
        """Record again with new settings; the trace so far is kept (up to ``max_entries``) unless ``clear``."""
        self.enabled, self.context = enabled, context
        maxlen = max_entries if max_entries < sys.maxsize else None
        self.traces = [collections.deque(() if clear else t, maxlen=maxlen) for t in self.traces]
        if clear:
            self.frames.clear()

    def _entry(self, gpu: int, action: str, stream: int = 0, **fields) -> None:
        if self.enabled == "all":
            self.traces[gpu].append({"action": action, "stream": stream_handle(stream),
                                     "time_us": time.time_ns() // 1000, **fields})

    def segment_alloc(self, gpu: int, head: Block, size: int) -> None:
        """A segment of ``size`` bytes, whose first block is ``head``, was allocated from ``gpu``."""
        self._entry(gpu, "segment_alloc", head.stream, addr=head.addr, size=size,
                    frames=_frames() if self.context else [])

    def segment_free(self, gpu: int, segment: Block) -> None:
        """The segment ``segment`` (one free block) went back to ``gpu``."""
        self._entry(gpu, "segment_free", segment.stream, addr=segment.addr, size=segment.size, frames=[])

    def alloc(self, gpu: int, block: Block) -> None:
        """``block`` was handed out on ``gpu``."""
        frames = _frames() if self.context else []
        self.frames[block.addr] = frames
        self._entry(gpu, "alloc", block.stream, addr=block.addr, size=block.size, frames=frames)

    def free(self, gpu: int, block: Block) -> None:
        """``block`` is being freed: requested and completed at once (nothing waits on another stream)."""
        self.frames.pop(block.addr, None)
        self._entry(gpu, "free_requested", block.stream, addr=block.addr, size=block.size, frames=[])
        self._entry(gpu, "free_completed", block.stream, addr=block.addr, size=block.size, frames=[])

    def oom(self, gpu: int, size: int, device_free: int) -> None:
        """The allocator raised OutOfMemoryError for ``size`` bytes."""
        self._entry(gpu, "oom", size=size, device_free=device_free,
                    frames=_frames() if self.context else [])


def stream_handle(stream: int) -> int:
    """The ``cudaStream_t`` of the emulated stream of id ``stream``: its ``cuda_stream``, and what snapshots show."""
    return 0x1000 * stream


def snapshot(devices: list[DeviceMemory], history: History | None) -> dict:
    """The dictionary ``torch.cuda.memory._snapshot()`` returns: every GPU's segments and their blocks.

    A block allocated while nothing recorded has no stack.
    """
    frames = history.frames if history is not None else {}
    segments = []
    for gpu, d in enumerate(devices):
        for addr in sorted(d.segments):
            blocks = []
            for b in d.segment_blocks(d.segments[addr]):
                blocks.append({"address": b.addr, "size": b.size,
                               "requested_size": b.requested if b.allocated else 0,
                               "state": "active_allocated" if b.allocated else "inactive",
                               "frames": frames.get(b.addr, []) if b.allocated else []})
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            segments.append({"device": gpu, "address": addr, "total_size": sum(b["size"] for b in blocks),
                             "allocated_size": allocated, "active_size": allocated,
                             "requested_size": sum(b["requested_size"] for b in blocks),
                             "stream": stream_handle(d.segments[addr].stream),
                             "segment_type": "large" if d.segments[addr].pool else "small",
                             "segment_pool_id": (0, 0), "is_expandable": False, "frames": blocks[0]["frames"],
                             "blocks": blocks})
    traces = [list(t) for t in history.traces] if history is not None else [[] for _ in devices]
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
