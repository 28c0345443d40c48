"""Collectives among one process's GPUs: ``torch.cuda.comm`` and ``torch.cuda.nccl`` (``nn.DataParallel``).

``nn.DataParallel`` (and the Trainer of Hugging Face transformers, which wraps a
model in it when one process sees several GPUs) copies the module to every GPU
with ``broadcast_coalesced``, splits the batch with ``scatter``, gathers the
outputs with ``gather`` and sums the gradients with ``reduce_add_coalesced``
(NCCL's single-process ``reduce``). Their C++ entry points
(``torch/csrc/cuda/python_comm.cpp``, ``python_nccl.cpp``) are missing from a
CPU build: ``module 'torch._C' has no attribute '_scatter'``. Here each is
the copies and sums it stands for, on the emulated tensors, with the results
torch documents (the input itself where it already is on a destination GPU).
"""

from __future__ import annotations

import torch

#: ncclRedOp_t, as torch.cuda.nccl passes it
_SUM, _PROD, _MAX, _MIN, _AVG = range(5)


def _on(t: torch.Tensor, gpu: int) -> torch.Tensor:
    """``t`` on GPU ``gpu`` (``-1``: the host): itself if it is there already, else a copy."""
    device = torch.device("cpu") if gpu == -1 else torch.device("cuda", gpu)
    return t if t.device == device else t.to(device)


def broadcast(tensor: torch.Tensor, devices: list[int]) -> list[torch.Tensor]:
    """``torch._C._broadcast``: ``tensor`` on each of ``devices``."""
    return [_on(tensor, d) for d in devices]


def broadcast_out(tensor: torch.Tensor, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """``torch._C._broadcast_out``: ``tensor`` copied into each of ``out``."""
    for o in out:
        o.copy_(tensor)
    return list(out)


def broadcast_coalesced(tensors: list[torch.Tensor], devices: list[int], buffer_size: int = 0) -> list[list]:
    """``torch._C._broadcast_coalesced``: per device, ``tensors`` there (the first device's are ``tensors``)."""
    for t in tensors:
        if t.get_device() != devices[0]:
            raise RuntimeError(f"All tensors must be on devices[0]: {devices[0]}")
    return [list(tensors)] + [[t.detach().to(torch.device("cuda", d)) for t in tensors] for d in devices[1:]]


def _chunks(tensor: torch.Tensor, n: int, chunk_sizes, dim: int) -> list[torch.Tensor]:
    if chunk_sizes is None:
        return list(tensor.chunk(n, dim))
    if len(chunk_sizes) != n or sum(chunk_sizes) != tensor.size(dim):
        raise RuntimeError(f"Expected chunk_sizes to have {n} sizes summing to {tensor.size(dim)}, got {chunk_sizes}")
    return list(tensor.split(list(chunk_sizes), dim))


def scatter(tensor: torch.Tensor, devices: list[int], chunk_sizes=None, dim: int = 0, streams=None) -> list:
    """``torch._C._scatter``: ``tensor`` split along ``dim``, chunk ``i`` on ``devices[i]``."""
    return [_on(c, d) for c, d in zip(_chunks(tensor, len(devices), chunk_sizes, dim), devices)]


def scatter_out(tensor: torch.Tensor, out: list[torch.Tensor], dim: int = 0, streams=None) -> list:
    """``torch._C._scatter_out``: ``tensor`` split along ``dim`` into ``out``."""
    for c, o in zip(_chunks(tensor, len(out), [o.size(dim) for o in out], dim), out):
        o.copy_(c)
    return list(out)


def gather(tensors: list[torch.Tensor], dim: int = 0, destination: int | None = None) -> torch.Tensor:
    """``torch._C._gather``: ``tensors`` concatenated along ``dim`` on GPU ``destination`` (-1: the host)."""
    if destination is None:
        destination = torch.cuda.current_device()
    return torch.cat([_on(t, destination) for t in tensors], dim)


def gather_out(tensors: list[torch.Tensor], out: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch._C._gather_out``: ``tensors`` concatenated along ``dim`` into ``out``."""
    return torch.cat([_on(t, out.get_device()) for t in tensors], dim, out=out)


def _reduce(inputs: list[torch.Tensor], op: int, gpu: int) -> torch.Tensor:
    parts = [_on(t, gpu) for t in inputs]
    if op in (_SUM, _AVG):
        out = torch.stack(parts).sum(0)
        return out / len(parts) if op == _AVG else out
    if op == _PROD:
        return torch.stack(parts).prod(0)
    if op in (_MAX, _MIN):
        return torch.stack(parts).amax(0) if op == _MAX else torch.stack(parts).amin(0)
    raise ValueError(f"unknown NCCL reduction op {op}")


def nccl_all_reduce(inputs, outputs, op=_SUM, streams=None, comms=None) -> None:
    """``torch._C._nccl_all_reduce``: every output gets the reduction of every input (they may be the inputs)."""
    whole = _reduce(inputs, op, inputs[0].get_device())
    for o in outputs:
        o.copy_(whole)


def nccl_reduce(inputs, output, root=0, op=_SUM, streams=None, comms=None) -> None:
    """``torch._C._nccl_reduce``: ``output`` (on ``inputs[root]``'s GPU) gets the reduction of every input."""
    output.copy_(_reduce(inputs, op, output.get_device()))


def nccl_broadcast(inputs, root=0, streams=None, comms=None) -> None:
    """``torch._C._nccl_broadcast``: every input gets ``inputs[root]``."""
    for i, t in enumerate(inputs):
        if i != root:
            t.copy_(inputs[root])


def nccl_all_gather(inputs, outputs, streams=None, comms=None) -> None:
    """``torch._C._nccl_all_gather``: every output gets every input, concatenated in order."""
    whole = torch.cat([_on(t, inputs[0].get_device()).reshape(-1) for t in inputs])
    for o in outputs:
        o.copy_(whole.view_as(o))


def nccl_reduce_scatter(inputs, outputs, op=_SUM, streams=None, comms=None) -> None:
    """``torch._C._nccl_reduce_scatter``: output ``i`` gets part ``i`` of the reduction of every input."""
    whole = _reduce(inputs, op, inputs[0].get_device()).reshape(-1)
    for i, o in enumerate(outputs):
        o.copy_(whole[i * o.numel():(i + 1) * o.numel()].view_as(o))


def install() -> None:
    """Give the CPU build's ``torch._C`` the entry points ``torch.cuda.comm`` and ``torch.cuda.nccl`` call."""
    for name, fn in {
        "_broadcast": broadcast, "_broadcast_out": broadcast_out, "_broadcast_coalesced": broadcast_coalesced,
        "_scatter": scatter, "_scatter_out": scatter_out, "_gather": gather, "_gather_out": gather_out,
        "_nccl_all_reduce": nccl_all_reduce, "_nccl_reduce": nccl_reduce, "_nccl_broadcast": nccl_broadcast,
        "_nccl_all_gather": nccl_all_gather, "_nccl_reduce_scatter": nccl_reduce_scatter,
    }.items():
        if not hasattr(torch._C, name):  # a build that has them keeps its own
            setattr(torch._C, name, fn)
