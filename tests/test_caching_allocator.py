"""The caching allocator's model (shim/memory/blocks.py) against c10's algorithm, case by case.

Each case is what c10/cuda/CUDACachingAllocator.cpp does, on sizes alone: the
segment a request allocates, best fit, splitting and merging, per-stream
reuse, the retry that frees cached segments, the out-of-memory of a
fragmented GPU whose allocated bytes plus the request would fit, and
``max_split_size_mb``.
"""

import pytest

from shim.memory.blocks import DeviceMemory, allocation_size, parse_alloc_conf, round_size

MiB = 1 << 20


def test_requests_round_to_512_bytes_and_take_c10s_segment_sizes():
    assert [round_size(n) for n in (1, 511, 512, 513, 4000)] == [512, 512, 512, 1024, 4096]
    assert allocation_size(512) == allocation_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == allocation_size(10 * MiB - 512) == 20 * MiB  # 1-10 MiB: 20 MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB + 1) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_a_2_mib_segment_and_large_ones_split_a_20_mib_one():
    d = DeviceMemory(1 << 30)
    a, b = d.malloc(4000, 0), d.malloc(100, 0)
    assert (a.pool, b.pool, b.addr - a.addr) == (0, 0, 4096)  # packed into one small segment
    blocks = [d.malloc(4 * MiB, 0) for _ in range(3)]
    assert d.reserved_total == 22 * MiB and d.segment.total == 2  # 3 x 4 MiB in one 20 MiB segment
    assert [x.addr - blocks[0].addr for x in blocks] == [0, 4 * MiB, 8 * MiB]
    assert d.allocated == 4096 + 512 + 12 * MiB
    # the free tails: the small segment's and the large segment's 8 MiB
    assert (d.inactive_split.total, d.inactive_split_bytes.total) == (2, 2 * MiB - 4608 + 8 * MiB)
    assert d.nested()["requested_bytes"]["all"]["current"] == 4100 + 12 * MiB


def test_a_freed_block_merges_with_its_free_neighbours_and_empty_cache_releases_whole_segments():
    d = DeviceMemory(1 << 30)
    a, b, c = (d.malloc(4 * MiB, 0) for _ in range(3))
    d.free(b)
    assert d.inactive_split.total == 2  # b's block and the 8 MiB tail, apart
    assert d.release_cached() == [] and d.reserved_total == 20 * MiB  # the segment is still split
    d.free(c)  # merges with b's block and the tail
    assert (d.inactive_split.total, d.inactive_split_bytes.total) == (1, 16 * MiB)
    d.free(a)  # the segment is whole again
    assert d.inactive_split.total == 0 and len(d.segments) == 1
    (released,) = d.release_cached()
    assert (released.size, d.reserved_total, d.nested()["num_device_free"]) == (20 * MiB, 0, 1)


def test_the_smallest_free_block_that_holds_the_request_is_taken():
    d = DeviceMemory(1 << 30)
    big, _, small, _ = d.malloc(12 * MiB, 0), d.malloc(12 * MiB, 0), d.malloc(6 * MiB, 0), d.malloc(2 * MiB, 0)
    d.free(big)  # a free 12 MiB segment, and small's 20 MiB segment holds 6 + 2 allocated, 12 free
    d.free(small)  # now 6 MiB free at its start
    again = d.malloc(5 * MiB, 0)
    assert again.addr == small.addr  # the 6 MiB block, not the 12 MiB ones
    assert again.size == 6 * MiB  # 1 MiB left over is not split off (the large pool splits > 1 MiB)
    assert d.reserved_total == 12 * MiB * 2 + 20 * MiB  # no segment added


def test_memory_freed_on_one_stream_is_reused_only_on_that_stream():
    d = DeviceMemory(1 << 30)
    d.free(d.malloc(12 * MiB, 0))
    d.malloc(12 * MiB, 7)
    assert d.reserved_total == 24 * MiB and d.segment.total == 2  # stream 7 could not take stream 0's
    d.malloc(12 * MiB, 0)
    assert d.reserved_total == 24 * MiB  # stream 0 takes its own back


def test_out_of_room_frees_the_cached_segments_and_retries():
    d = DeviceMemory(60 * MiB)
    a, _, c, _ = (d.malloc(12 * MiB, 0) for _ in range(4))
    d.free(a)
    d.free(c)
    assert d.would_fit(20 * MiB, 0)
    block = d.malloc(20 * MiB, 0)  # 48 reserved + 20 > 60: the two free 12 MiB segments go back first
    assert block is not None and d.reserved_total == 44 * MiB
    assert d.nested()["num_alloc_retries"] == 1 and d.nested()["num_device_free"] == 2


def test_a_fragmented_gpu_runs_out_of_memory_where_allocated_plus_the_request_would_fit():
    d = DeviceMemory(40 * MiB)
    five = [d.malloc(4 * MiB, 0) for _ in range(5)]  # one 20 MiB segment, exactly filled
    sixth = d.malloc(4 * MiB, 0)  # a second 20 MiB segment: 16 MiB of it stays free
    for x in five[::2]:
        d.free(x)  # 12 MiB free in the first segment, in three pieces
    assert d.allocated == 12 * MiB and d.reserved_total == 40 * MiB and sixth is not None
    assert not d.would_fit(18 * MiB, 0)
    assert d.malloc(18 * MiB, 0) is None  # 12 + 18 <= 40, but no free block holds 18 and no segment fits
    assert d.malloc(16 * MiB, 0) is not None  # the second segment's free 16 MiB does


def test_max_split_size_keeps_large_blocks_whole():
    max_split, unmodeled = parse_alloc_conf("max_split_size_mb:64,expandable_segments:False")
    assert (max_split, unmodeled) == (64 * MiB, [])
    d = DeviceMemory(1 << 30, max_split_size=max_split)
    d.free(d.malloc(100 * MiB, 0))
    d.malloc(30 * MiB, 0)  # may not split the cached 100 MiB block: a segment of its own
    assert d.reserved_total == 130 * MiB
    d.malloc(90 * MiB, 0)  # an oversize request takes the oversize block, whole, within 20 MiB of its size
    assert d.reserved_total == 130 * MiB and d.allocated == 130 * MiB
    assert d.nested()["oversize_allocations"]["current"] == 1 and d.nested()["max_split_size"] == 64 * MiB


@pytest.mark.parametrize("text, error", [("max_split_size_mb:8", "must be > 20"),
                                         ("max_split_size_mb", "expected key:value"),
                                         ("max_split_size_mb:big", "whole number of MiB")])
def test_a_malformed_allocator_setting_is_refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse_alloc_conf(text)


def test_settings_the_model_does_not_follow_are_named():
    # expandable_segments is named too: the allocator warns as a ROCm build does, and allocates without it
    assert parse_alloc_conf("expandable_segments:True, garbage_collection_threshold:0.6,backend:native") == (
        1 << 64, ["expandable_segments", "garbage_collection_threshold"])
    assert parse_alloc_conf("expandable_segments:False") == (1 << 64, [])
