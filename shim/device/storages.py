"""Which storage a tensor uses, as the allocator, the clock and the streams tell storages apart."""

from __future__ import annotations

import torch


def storage_key(t: torch.Tensor) -> int:
    """The storage of ``t`` (a plain tensor): its address, or for a meta tensor (estimate mode), which has
    none, its C++ storage object's."""
    s = t.untyped_storage()
    return s.data_ptr() or s._cdata
