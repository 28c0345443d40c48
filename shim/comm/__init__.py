"""The ``nccl`` process group and its place in torch.distributed: c10d's patches and call forms, world
formation and registration, fault injection, FSDP2/DTensor's hooks, ``torch.cuda.comm``.
"""
