"""How a collective travels once the process group has posted it: the transports (shared-memory
arenas, the socket, rank to rank, zero-copy buffers) behind one ``Call``, the stream of collectives in flight,
and what NCCL prints and records about them.
"""
