"""The socket transport's input bytes in the daemon: from the data frames after a request to its job.

A ``Collective`` over NET/Socket carries no arena: its rank's bytes follow it as
data frames of ``MAX_DATA_FRAME_BYTES`` (:func:`from_frames` reads them without
copying). :class:`SocketPayloads` holds them, once they match the shape the
request declares, until the scheduler makes the job that consumes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import zmq

from emulator.ledger import CommError, Communicator, Posted
from emulator.scheduler import input_elements
from wire import schema as s
from wire.kernels import Segmented, itemsize

#: A socket-transport rank's bytes as received: one frame's, or several frames read as one array.
Payload = np.ndarray | Segmented


def from_frames(frames: Sequence[zmq.Frame]) -> tuple[str, Payload | None]:
    """The bytes of a socket-transport collective's data frames, or why the frames are malformed.

    Frames are MAX_DATA_FRAME_BYTES each but the last (1 byte to that), so
    their count follows from the total and element boundaries never straddle
    two frames. Several frames are read as one array without copying them.
    """
    if not frames:
        return "", None
    full = s.MAX_DATA_FRAME_BYTES
    sizes = [len(f) for f in frames]
    if any(n != full for n in sizes[:-1]) or not 0 < sizes[-1] <= full:
        return (f"data frames of {sizes[:8]} bytes: each must be {full} bytes but the last, "
                f"which holds 1 to {full}"), None
    parts = [np.frombuffer(f.buffer, np.uint8) for f in frames]
    return "", parts[0] if len(parts) == 1 else Segmented(parts)


class SocketPayloads:
    """Inputs received and not yet consumed: comm -> (client, request id) -> the rank's bytes.

    Kept per communicator so that a failure drops all of its ranks' bytes at once.
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[tuple[bytes, int], Payload]] = {}
        self.received = 0  # bytes taken so far: daemon.log's last line says how much data came through here

    def hold(self, client: bytes, req: s.Collective, payload: Payload | None, comms: dict[str, Communicator]) -> None:
        """Keep a socket-transport rank's bytes for its job; raise ``CommError`` unless they match its shape.

        ``comms`` is the ledger's: a rank that never joined the communicator it names has nothing held (the
        ledger refuses that post). Looked up only for the socket transport, not on every collective.
        """
        if req.transport is not s.Transport.SOCKET:
            return
        comm = comms.get(req.comm)
        if comm is None:
            return
        want = input_elements(req, comm.size) * itemsize(req.dtype)
        got = 0 if payload is None else len(payload)
        if got != want:
            raise CommError(
                "ncclInvalidArgument",
                f"rank {req.rank} sent {got} bytes of data frames with {req.op.value} #{req.seq} of "
                f"{req.numel} x {req.dtype}, which needs {want}",
            )
        self.received += got
        if payload is not None:
            self._held.setdefault(req.comm, {})[(client, req.req)] = payload

    def take(self, p: Posted) -> Payload | None:
        """The bytes a socket-transport rank sent with its request (taken: each is consumed once)."""
        return self._held.get(p.request.comm, {}).pop((p.client, p.request.req), None)

    def discard(self, client: bytes, req: s.Collective) -> None:
        """Forget one request's bytes: the ledger refused its post."""
        self._held.get(req.comm, {}).pop((client, req.req), None)

    def drop(self, comm: str) -> None:
        """Forget every byte held for ``comm``: it failed, and nobody will run on them."""
        self._held.pop(comm, None)
