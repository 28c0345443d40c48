"""One emulated GPU's caching allocator: its segments, the blocks they split into, and its statistics.

The HIP caching allocator is c10's ``CUDACachingAllocator`` hipified, and what
``torch.cuda.memory_reserved()``, ``max_memory_reserved()`` (torchtitan's
"memory:" figure), ``mem_get_info()`` and an out-of-memory error say follows
from its algorithm, which this module replays on sizes alone (no torch, no
memory behind the addresses):

- A request is rounded up to 512 bytes. Requests up to 1 MiB come from the
  small pool, larger ones from the large pool; each pool keeps the free blocks
  of its segments, per stream.
- The smallest free block of the pool, on the request's stream, that holds the
  request is taken (best fit, the lowest address among equals). Failing that, a
  new segment is allocated from the device: 2 MiB for a small request, 20 MiB
  for one under 10 MiB, else the request rounded up to 2 MiB. If the device has
  no room, every free block that is a whole segment is released and the device
  asked again; failing that, out of memory.
- What the block holds beyond the request is split off as a free block when at
  least 512 bytes remain (small pool) or more than 1 MiB (large pool); a block
  freed merges with free neighbours of its segment. ``empty_cache()`` releases
  the free whole segments.
- ``max_split_size_mb`` (``PYTORCH_CUDA_ALLOC_CONF``) keeps blocks at or above
  it whole, and a request below it from taking one.

Memory freed on one stream is reused only by allocations on that stream, as
on the GPU; nothing waits on another stream's work here, so a block is free
for reuse as soon as it is freed (``record_stream`` delays nothing).
Addresses are virtual: each segment gets the next free range of a GPU-like
address space, so snapshots show segments and blocks as torch's would.
"""

from __future__ import annotations

import bisect

MIN_BLOCK = 512  # every request is rounded up to this
SMALL_SIZE = 1 << 20  # the largest request of the small pool
SMALL_BUFFER = 2 << 20  # the segment a small request allocates
LARGE_BUFFER = 20 << 20  # the segment a request between 1 and 10 MiB allocates
MIN_LARGE_ALLOC = 10 << 20  # from here a request allocates a segment of its own size
ROUND_LARGE = 2 << 20  # which is rounded up to this
NO_MAX_SPLIT = 1 << 64  # max_split_size unset: every block may be split
_BASE = 0x7F00_0000_0000  # where GPU 0's address range starts
_SPAN = 1 << 40  # each GPU's range: more than any GPU's memory, so no two GPUs' addresses meet
_SIZE_SHIFT = 56  # a free block's key: stream, size and offset in its GPU's range, in one int
_STREAM_SHIFT = 112
_ADDR_MASK = (1 << 56) - 1


#: ``PYTORCH_CUDA_ALLOC_CONF`` settings that change what the allocator reserves and this model does not follow
#: (``expandable_segments`` is not among them: a ROCm build ignores it, with a warning, and so does the model)
UNMODELED = ("garbage_collection_threshold", "roundup_power2_divisions", "max_non_split_rounding_mb")


def parse_alloc_conf(text: str) -> tuple[int, list[str]]:
    """``PYTORCH_CUDA_ALLOC_CONF``'s ``max_split_size_mb`` in bytes, and the settings it names that change
    what is reserved and the model does not follow (``expandable_segments`` among them where it is on).
    A ValueError for a malformed setting, as torch refuses it."""
    max_split, unmodeled = NO_MAX_SPLIT, []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"allocator config {text!r}: expected key:value, got {item!r}")
        if key == "max_split_size_mb":
            try:
                mb = int(value)
            except ValueError:
                raise ValueError(f"allocator config: max_split_size_mb must be a whole number of MiB, "
                                 f"not {value!r}") from None
            if mb <= LARGE_BUFFER >> 20:
                raise ValueError(f"CachingAllocator option max_split_size_mb too small, must be > "
                                 f"{LARGE_BUFFER >> 20}")
            max_split = mb << 20
        elif key in (*UNMODELED, "expandable_segments") and value.lower() not in ("false", "0", "0.0"):
            unmodeled.append(key)
    return max_split, unmodeled


def round_size(n: int) -> int:
    """The block size a request of ``n`` bytes takes."""
    return MIN_BLOCK if n < MIN_BLOCK else (n + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment a block of ``size`` bytes allocates when no cached block holds it."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


class Stat:
    """One statistic of ``torch.cuda.memory_stats()``: current, peak, allocated and freed, per pool and all."""

    __slots__ = ("current", "peak", "allocated", "freed", "all_peak")

    def __init__(self) -> None:
        self.current = [0, 0]  # [small pool, large pool]
        self.peak = [0, 0]
        self.allocated = [0, 0]
        self.freed = [0, 0]
        self.all_peak = 0  # the peak of the total, which is not the sum of the pools' peaks

    def add(self, pool: int, n: int) -> None:
        c = self.current
        c[pool] += n
        self.allocated[pool] += n
        if c[pool] > self.peak[pool]:
            self.peak[pool] = c[pool]
        if c[0] + c[1] > self.all_peak:
            self.all_peak = c[0] + c[1]

    def sub(self, pool: int, n: int) -> None:
        self.current[pool] -= n
        self.freed[pool] += n

    @property
    def total(self) -> int:
        return self.current[0] + self.current[1]

    def table(self) -> dict:
        """The nested form: ``{"all": {...}, "small_pool": {...}, "large_pool": {...}}``."""
        out = {"all": {"current": self.total, "peak": self.all_peak, "allocated": sum(self.allocated),
                       "freed": sum(self.freed)}}
        for i, name in enumerate(("small_pool", "large_pool")):
            out[name] = {"current": self.current[i], "peak": self.peak[i], "allocated": self.allocated[i],
                         "freed": self.freed[i]}
        return out

    def reset_peak(self) -> None:
        self.peak = list(self.current)
        self.all_peak = self.total

    def reset_accumulated(self) -> None:
        self.allocated = [0, 0]
        self.freed = [0, 0]


class Block:
    """A range of a segment: handed out (``allocated``) or cached free; ``prev``/``next`` are its neighbours."""

    # gpu and holders are the Allocator's: a block handed out is also its record of the storage it holds
    __slots__ = ("addr", "size", "requested", "stream", "pool", "allocated", "prev", "next", "gpu", "holders")

    def __init__(self, addr: int, size: int, stream: int, pool: int, prev: Block | None = None,
                 next: Block | None = None) -> None:  # noqa: A002 - c10's name
        self.gpu = 0
        self.holders = 0
        self.addr = addr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.pool = pool
        self.allocated = False
        self.prev = prev
        self.next = next

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class DeviceMemory:
    """One GPU's allocator: its segments, its pools of free blocks, and the statistics torch reports."""

    def __init__(self, capacity: int, index: int = 0, max_split_size: int = NO_MAX_SPLIT):
        self.capacity = capacity
        self.fraction = 1.0  # set_per_process_memory_fraction
        self.max_split_size = max_split_size
        self.allocated_bytes = Stat()
        self.allocation = Stat()
        self.requested_bytes = Stat()
        self.reserved_bytes = Stat()
        self.segment = Stat()
        self.inactive_split = Stat()
        self.inactive_split_bytes = Stat()
        self.oversize_allocations = Stat()  # counted in pool 1 (blocks at or above max_split_size are large)
        self.oversize_segments = Stat()
        self.num_alloc_retries = 0
        self.num_sync_all_streams = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        # free blocks per pool, ordered as c10's BlockComparatorSize, (stream, size, address), packed in one
        # int each (ints cost the garbage collector nothing, and compare faster than tuples)
        self._free: tuple[list[int], list[int]] = ([], [])
        self._cached: dict[int, Block] = {}  # a free block's address -> the block
        self.segments: dict[int, Block] = {}  # a segment's address -> its first block
        self._base = self._next_addr = _BASE + index * _SPAN
        self.released: list[Block] = []  # the segments a retry released, until the caller takes them

    # ---------------------------------------------------------------- figures

    @property
    def allocated(self) -> int:
        return self.allocated_bytes.total

    @property
    def all_peak(self) -> int:
        return self.allocated_bytes.all_peak

    @property
    def reserved_total(self) -> int:
        return self.reserved_bytes.total

    @property
    def touched(self) -> bool:
        """Whether this GPU ever allocated a segment."""
        return self._next_addr != self._base

    @property
    def limit(self) -> int:
        return int(self.capacity * self.fraction)

    def nested(self) -> dict:
        """The nested dict ``torch._C._cuda_memoryStats`` returns on a GPU build."""
        allocated = self.allocated_bytes.table()
        count = self.allocation.table()
        return {
            "allocated_bytes": allocated,
            "active_bytes": allocated,  # nothing waits on another stream's work: active == allocated
            "requested_bytes": self.requested_bytes.table(),
            "reserved_bytes": self.reserved_bytes.table(),
            "inactive_split_bytes": self.inactive_split_bytes.table(),
            "allocation": count,
            "active": count,
            "segment": self.segment.table(),
            "inactive_split": self.inactive_split.table(),
            "oversize_allocations": self.oversize_allocations.table()["all"],
            "oversize_segments": self.oversize_segments.table()["all"],
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_sync_all_streams": self.num_sync_all_streams,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "max_split_size": -1 if self.max_split_size == NO_MAX_SPLIT else self.max_split_size,
        }

    def _stats(self):
        return (self.allocated_bytes, self.allocation, self.requested_bytes, self.reserved_bytes, self.segment,
                self.inactive_split, self.inactive_split_bytes, self.oversize_allocations, self.oversize_segments)

    def reset_peak(self) -> None:
        """``reset_peak_memory_stats``: peaks restart from the current figures."""
        for s in self._stats():
            s.reset_peak()

    def reset_accumulated(self) -> None:
        """``reset_accumulated_memory_stats``: the allocated/freed totals and the event counts restart."""
        for s in self._stats():
            s.reset_accumulated()
        self.num_alloc_retries = self.num_sync_all_streams = self.num_ooms = 0
        self.num_device_alloc = self.num_device_free = 0

    # ---------------------------------------------------------------- allocating

    def malloc(self, nbytes: int, stream: int, force: bool = False) -> Block | None:
        """A block for a request of ``nbytes`` on ``stream``; None where the GPU is out of memory (unless
        ``force``: the block is made past the limit, for an allocation the host has already made).

        Every tensor's birth passes here, so the common path is written out in one function.
        """
        size = MIN_BLOCK if nbytes < MIN_BLOCK else (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
        pool = 0 if size <= SMALL_SIZE else 1
        free = self._free[pool]
        block = None
        if free:
            i = bisect.bisect_left(free, (stream << _STREAM_SHIFT) | (size << _SIZE_SHIFT))
            if i < len(free) and free[i] >> _STREAM_SHIFT == stream and (
                    self.max_split_size == NO_MAX_SPLIT or self._may_take(free[i], size)):
                block = self._cached.pop(self._base + (free.pop(i) & _ADDR_MASK))
        if block is None:
            block = self._new_block(pool, stream, size, force)
            if block is None:
                return None
        # hand it out, splitting off what it holds beyond the request where c10 would
        was_split = block.prev is not None or block.next is not None
        rest = block.size - size
        if rest >= MIN_BLOCK if pool == 0 else (rest > SMALL_SIZE and size < self.max_split_size):
            tail = Block(block.addr + size, rest, stream, pool, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            bisect.insort(free, (stream << _STREAM_SHIFT) | (rest << _SIZE_SHIFT) | (tail.addr - self._base))
            self._cached[tail.addr] = tail
            if was_split:  # a free part of a split segment shrank by what is handed out
                self.inactive_split_bytes.sub(pool, size)
            else:  # a whole segment became split: its free tail is an inactive split block
                self.inactive_split_bytes.add(pool, rest)
                self.inactive_split.add(pool, 1)
        elif was_split:  # a free part of a split segment is handed out whole
            self.inactive_split_bytes.sub(pool, block.size)
            self.inactive_split.sub(pool, 1)
        block.allocated = True
        block.requested = nbytes
        size = block.size
        for stat, n in ((self.allocated_bytes, size), (self.allocation, 1), (self.requested_bytes, nbytes)):
            c = stat.current
            c[pool] += n
            stat.allocated[pool] += n
            if c[pool] > stat.peak[pool]:
                stat.peak[pool] = c[pool]
            if c[0] + c[1] > stat.all_peak:  # not only when this pool peaks: the other may have been higher
                stat.all_peak = c[0] + c[1]
        if size >= self.max_split_size:
            self.oversize_allocations.add(1, 1)
        return block

    def _may_take(self, key: int, size: int) -> bool:
        """With ``max_split_size`` set: whether the free block of ``key`` may serve a request of ``size``."""
        found = (key >> _SIZE_SHIFT) & _ADDR_MASK
        if size < self.max_split_size <= found:
            return False  # an oversize block is not split for a smaller request
        return not (size >= self.max_split_size and found >= size + LARGE_BUFFER)  # nor given far below its size

    def _new_block(self, pool: int, stream: int, size: int, force: bool) -> Block | None:
        """A new segment for a block of ``size``; where the GPU has no room, the cached whole segments are
        released and the GPU asked again (c10's retry), then None (or, ``force``, the segment anyway)."""
        alloc = allocation_size(size)
        block = self._new_segment(pool, stream, alloc, force=False)
        if block is None:
            self.released = self.release_cached()
            self.num_alloc_retries += 1
            block = self._new_segment(pool, stream, alloc, force=force)
        return block

    def would_fit(self, nbytes: int, stream: int) -> bool:
        """Whether :meth:`malloc` of ``nbytes`` on ``stream`` would succeed (nothing changes)."""
        size = round_size(nbytes)
        pool = 0 if size <= SMALL_SIZE else 1
        free = self._free[pool]
        i = bisect.bisect_left(free, (stream << _STREAM_SHIFT) | (size << _SIZE_SHIFT))
        if i < len(free) and free[i] >> _STREAM_SHIFT == stream and self._may_take(free[i], size):
            return True
        need = self.reserved_total + allocation_size(size) - self.limit
        # else a new segment, after the cached whole segments are released if need be
        return need <= 0 or sum(b.size for b in self._cached.values() if not b.is_split) >= need

    def _new_segment(self, pool: int, stream: int, size: int, force: bool) -> Block | None:
        if not force and self.reserved_total + size > self.limit:
            return None
        addr = self._next_addr
        self._next_addr += (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
        block = Block(addr, size, stream, pool)
        self.segments[addr] = block
        self.reserved_bytes.add(pool, size)
        self.segment.add(pool, 1)
        if size >= self.max_split_size:
            self.oversize_segments.add(1, 1)
        self.num_device_alloc += 1
        return block

    def _key(self, block: Block) -> int:
        return (block.stream << _STREAM_SHIFT) | (block.size << _SIZE_SHIFT) | (block.addr - self._base)

    def _cache(self, block: Block) -> None:
        bisect.insort(self._free[block.pool], self._key(block))
        self._cached[block.addr] = block

    def _uncache(self, block: Block) -> None:
        free = self._free[block.pool]
        del free[bisect.bisect_left(free, self._key(block))]
        del self._cached[block.addr]

    # ---------------------------------------------------------------- freeing

    def free(self, block: Block) -> None:
        """``block`` is freed: cached in its pool, merged with free neighbours of its segment."""
        pool = block.pool
        block.allocated = False
        size = block.size
        stat = self.allocated_bytes
        stat.current[pool] -= size
        stat.freed[pool] += size
        stat = self.allocation
        stat.current[pool] -= 1
        stat.freed[pool] += 1
        stat = self.requested_bytes
        stat.current[pool] -= block.requested
        stat.freed[pool] += block.requested
        if block.size >= self.max_split_size:
            self.oversize_allocations.sub(1, 1)
        prev, nxt = block.prev, block.next
        if prev is None and nxt is None:  # a whole segment: no neighbour to merge
            self._cache(block)
            return
        split_blocks, split_bytes = 0, 0
        if prev is not None and not prev.allocated:
            self._uncache(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if prev.prev is not None:
                prev.prev.next = block
            else:
                self.segments[block.addr] = block
            split_blocks -= 1
            split_bytes -= prev.size
        if nxt is not None and not nxt.allocated:
            self._uncache(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            split_blocks -= 1
            split_bytes -= nxt.size
        if block.is_split:
            split_blocks += 1
            split_bytes += block.size
        self._cache(block)
        if split_blocks > 0:
            self.inactive_split.add(pool, split_blocks)
        elif split_blocks < 0:
            self.inactive_split.sub(pool, -split_blocks)
        if split_bytes > 0:
            self.inactive_split_bytes.add(pool, split_bytes)
        elif split_bytes < 0:
            self.inactive_split_bytes.sub(pool, -split_bytes)

    def release_cached(self) -> list[Block]:
        """``empty_cache()``: give the free whole segments back to the device; the segments released."""
        self.num_sync_all_streams += 1  # c10 synchronizes every stream first
        released = [b for b in self._cached.values() if not b.is_split]
        for b in released:
            self._uncache(b)
            del self.segments[b.addr]
            self.reserved_bytes.sub(b.pool, b.size)
            self.segment.sub(b.pool, 1)
            if b.size >= self.max_split_size:
                self.oversize_segments.sub(1, 1)
            self.num_device_free += 1
        return released

    def segment_of(self, block: Block) -> Block:
        """The first block of ``block``'s segment."""
        while block.prev is not None:
            block = block.prev
        return block

    def segment_blocks(self, head: Block) -> list[Block]:
        """The blocks of the segment that starts with ``head``, in address order."""
        out = []
        b: Block | None = head
        while b is not None:
            out.append(b)
            b = b.next
        return out
