"""Ops a GPU build runs as fused or CUDA-only kernels, written for the host: attention, SyncBatchNorm's
kernels, and the functional collectives traced by DTensor, FSDP2 and torch.compile.
"""
