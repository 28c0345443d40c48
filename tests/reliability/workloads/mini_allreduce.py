"""One all-reduce through the session's daemon, without torch: a cheap rank for isolation tests.

Every node process is one rank (``RANK`` of ``WORLD_SIZE``); the communicator
id is the session id, so a rank that reached another session's daemon would
find nobody to reduce with. Prints what identifies its session.
"""

import os

import numpy as np
import zmq

from wire import schema as s
from wire.arena import Arena, arena_name

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
session, token = os.environ["MIRAGE_SESSION"], os.environ["MIRAGE_TOKEN"]
print(f"session={session} endpoint={os.environ['MIRAGE_ENDPOINT']} port={os.environ['MASTER_PORT']}", flush=True)
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(os.environ["MIRAGE_ENDPOINT"])


def call(msg):
    sock.send(s.encode(msg))
    assert sock.poll(30_000), "no reply from the daemon"
    return s.decode(sock.recv())


arena = Arena.create(arena_name(session, f"mini-r{rank}-g1"), 4096)
try:
    assert isinstance(call(s.CommInit(token=token, req=1, comm=session, rank=rank, size=world, global_rank=rank,
                                      node=rank, host=f"mirage-node-{rank}")), s.Ok)
    arena.bytes_view(0, 64).view(np.float32)[:] = rank + 1
    reply = call(s.Collective(token=token, req=2, comm=session, seq=1, rank=rank, numel=16, out_numel=16,
                              arena=arena.name, site="mini_allreduce.py:33:<module>"))
    assert isinstance(reply, s.Done), reply
    print(f"mini sum={arena.bytes_view(0, 64).view(np.float32)[0]:g}", flush=True)
finally:
    arena.close()
    arena.unlink()
