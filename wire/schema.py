"""The wire format shared by the daemon, the shim and the console: one import for its two halves.

:mod:`wire.messages` is the catalogue (every request, reply and event as a
frozen dataclass, the limits, the enums); :mod:`wire.codec` turns them into
JSON bytes and back (``encode``, ``decode``, the event frames). Code on either
side of a socket imports this module (``from wire import schema as s``),
so ``s.Collective`` and ``s.encode`` sit side by side, and importing it also
installs the codec's generated ``__init__`` on every message class.
"""

from __future__ import annotations

# (``x as x``: re-exported names)
from wire.codec import decode as decode
from wire.codec import decode_events as decode_events
from wire.codec import encode as encode
from wire.codec import encode_events as encode_events
from wire.codec import iter_events as iter_events
from wire.messages import *  # noqa: F403  (the catalogue; its __all__ names every message)
