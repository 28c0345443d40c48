"""The shim's C++ sources and their build: the device guard, fast dispatch, the collectives' profiler
records and the pinned host allocator, compiled on first use.
"""
