"""Emulated GPU memory: the caching allocator's model, its history and snapshots, and pinned host memory.
"""
