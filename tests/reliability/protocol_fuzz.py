"""A seeded generator of hostile daemon requests, shared by the test suite and ``bench/fuzz_daemon.py``.

Two kinds of message:

- :meth:`Fuzzer.refusable` — malformed, truncated, oversized, wrong-type,
  wrong-version, wrong-token, multi-frame, reply/event types sent as requests.
  Each must be answered by exactly one ``Error`` with code ``protocol`` (and a
  ``protocol_error`` event), whatever the daemon's state.
- :meth:`Fuzzer.hostile` — well formed and carrying the real token, but
  semantically wrong or out of order: collectives before joining, sequence
  numbers out of order, unknown or foreign arenas, impossible sizes, roots,
  peers, devices, offsets and splits, socket-transport data frames that do not
  match the declared shape, ranks that claim dead pids. The daemon may
  answer them with an error, an ``Ok``, a ``Done`` or (for half of a collective
  nobody completes) not at all; it must never crash, hang or raise internally.

No torch, no randomness outside ``random.Random(seed)``: a failure reproduces
from its seed.
"""

from __future__ import annotations

import json
import random
import dataclasses
import typing
from enum import Enum

from wire import schema as s
from wire.kernels import DTYPES

#: every request kind the schema knows (new ones are fuzzed too, with generic values)
REQUESTS = [cls for cls in s.MESSAGE_TYPES.values() if issubclass(cls, s.Request)]
NOT_REQUESTS = ["ok", "error", "done", "daemon_ready", "coll_completed", "hang", "session_ended", "output"]
_INT_JUNK = [None, True, False, 1.5, "7", "", [], {}, [1], {"a": 1}, float("nan")]
_STR_JUNK = [None, True, 0, -1, 2**70, 1.5, [], {}, ["x"], {"k": "v"}]
_LIST_JUNK = [None, True, 0, "1,2", {}, [None], ["1"], [1.5], [True], [[1]]]
_STR_LIST_JUNK = [None, True, 0, "h1", {}, [None], [1], [1.5], [True], [["h1"]]]
_FLOAT_JUNK = [None, True, False, "1.5", "", [], {}, [1.0], {"a": 1.0}, "nan"]
_DICT_JUNK = [None, True, 0, "h1", [], [["h1", "x"]], {"h1": "x"}, {"h1": [1, 2]}, {"h1": None}, {"": [[]]}]


def _field_types(cls) -> dict[str, str]:
    """``int``, ``float``, ``str``, ``bool``, ``list`` (of ints), ``list[str]``, ``dict`` or ``enum`` for each field of
    a request class."""
    out = {}
    hints = typing.get_type_hints(cls)
    for name in (f.name for f in dataclasses.fields(cls)):  # the fields, not the class variables
        hint = hints[name]
        if typing.get_origin(hint) is list:
            out[name] = "list[str]" if typing.get_args(hint) == (str,) else "list"
        elif typing.get_origin(hint) is dict:
            out[name] = "dict"
        elif isinstance(hint, type) and issubclass(hint, Enum):
            out[name] = "enum"
        else:
            out[name] = hint.__name__
    return out


_TYPES = {cls: _field_types(cls) for cls in REQUESTS}


class Fuzzer:
    """Seeded source of hostile requests against the daemon of ``session`` (token ``token``)."""

    def __init__(self, seed: int, token: str, session: str, arenas: list[str], big: bool = True):
        self.gen = random.Random(seed)
        self.token = token
        self.session = session
        self.big = big  # allow the rare 1-2 MiB and deeply nested frames
        g = self.gen
        self.comms = [f"{g.getrandbits(128):032x}" for _ in range(4)]
        self.real_arenas = arenas
        self.joined: dict[str, int] = {}  # communicators hostile() joined, and their sizes
        self.next_seq: dict[str, int] = {}
        self.next_p2p: dict[tuple[str, int, int], int] = {}
        self.arenas = arenas + [
            "", "../../etc/passwd", "/etc/passwd", f"mirage-{session}-", f"mirage-{session}-missing",
            f"mirage-{session}-../x", "mirage-deadbeef-r0-g1", f"mirage-{session}x-r0", "x" * 300,
        ]

    # ------------------------------------------------------------ well-formed pieces

    def _int(self) -> int:
        g = self.gen
        return g.choice([0, 1, 2, 3, 4, -1, -2, 7, 64, 4096, 2**31, 2**40, 2**62, -(2**63), g.randrange(-100, 100)])

    def _str(self) -> str:
        g = self.gen
        return g.choice(["", "x", "float32", "\u0000", "\ud7ff\u00e9", "a" * g.randrange(1, 2000), "%s%n{}", "\n\n"])

    def valid(self, cls=None, token: str | None = None) -> dict:
        """A request as a JSON object: right types, random values, the real token unless told."""
        g = self.gen
        cls = cls or g.choice(REQUESTS)
        body: dict = {"v": s.VERSION, "type": cls.TYPE, "token": self.token if token is None else token,
                      "req": g.randrange(1, 2**31)}
        if cls is s.Hello:
            body.update(rank=self._int(), node=self._int(),
                        pid=g.choice([0, 1, -5, 2**22 + 7, 4_000_000, g.randrange(2, 60000)]))
        elif cls is s.CommInit:
            body.update(comm=g.choice(self.comms), rank=g.choice([0, 1, 2, 3, -1, 2**40]),
                        size=g.choice([1, 2, 3, 4, 0, -1, 2**40, 2**62]), global_rank=self._int(), node=self._int(),
                        host=g.choice(["h0", "h1", ""]), transport=g.choice(["shm", "socket", "p2p", self._str()]),
                        name=g.choice(["0", "", self._str()]), desc=g.choice(["default_pg", "mesh_tp", self._str()]))
        elif cls is s.Collective:
            op = g.choice(list(s.CollOp))
            numel = g.choice([0, 1, 4, 16, 256, -1, 2**50, g.randrange(0, 1024)])
            body.update(
                comm=g.choice(self.comms), seq=g.choice([1, 1, 2, 3, 0, -1, 5, 2**62]), rank=g.choice([0, 1, 2, 3, -1]),
                op=op.value, reduce_op=g.choice(list(s.ReduceOp)).value,
                dtype=g.choice(["float32", "float32", "bfloat16", "int64", "bool", "uint8", "complex64", "", "object"]),
                numel=numel, out_numel=g.choice([numel, numel * 2, 0, 1, -3, 2**60]), root=g.choice([0, 1, 2, -1, 99]),
                device=g.choice([0, 1, 2, 3, -1, 99]), arena=g.choice(self.arenas),
                in_off=g.choice([0, 0, 64, 4095, -64, 2**62]), out_off=g.choice([0, 64, 1024, -1, 2**62]),
                site=self._str()[:200],
                splits=g.choice([[], [1, 3], [2, 2], [-1, 5], [0] * 300, [2**62, 1], [4]]),
                peer=g.choice([-1, 0, 1, 2, 3, 2**40]),
            )
        elif cls is not s.Ping:  # a request kind without a generator of its own: any values of the right types
            for name, kind in _TYPES[cls].items():
                if name in body:
                    continue
                if kind == "int":
                    body[name] = self._int()
                elif kind == "float":
                    body[name] = g.choice([0.0, 1e-6, 0.25, 3.5e3, -1.0, 1e300, g.random()])
                elif kind == "str":
                    body[name] = self._str()
                elif kind == "bool":
                    body[name] = g.choice([True, False])
                elif kind == "list":
                    body[name] = [self._int() for _ in range(g.randrange(4))]
                elif kind == "list[str]":
                    body[name] = [self._str()[:16] for _ in range(g.randrange(4))]
                elif kind == "dict":  # a peer directory: host -> [endpoint, cipher], well typed, any values
                    body[name] = {self._str()[:16]: [self._str()[:40] for _ in range(g.randrange(4))]
                                  for _ in range(g.randrange(3))}
                else:
                    hint = typing.get_type_hints(cls)[name]
                    body[name] = g.choice(list(hint)).value
        return body

    @staticmethod
    def dumps(body) -> bytes:
        return json.dumps(body, separators=(",", ":")).encode("utf-8", "surrogatepass")

    # ------------------------------------------------------------ hostile but well-formed

    def hostile(self) -> list[list[bytes]]:
        """Well-formed requests with the real token (one or a few messages, each its frames, to send in order).

        Mostly plausible traffic, so the fuzz reaches the ledger, the scheduler
        and the kernels rather than stopping at "not joined": communicators
        joined properly, collectives posted by every rank with matching
        parameters and then one field of one rank twisted, a rank left out (a
        hang), sequence numbers repeated or skipped, sends without receives.
        The daemon may answer with anything, or not at all; it must not fail.
        """
        g = self.gen
        roll = g.random()
        if roll < 0.1 or not self.joined:  # a new communicator, every rank joining (or all but one)
            comm, size = f"{g.getrandbits(128):032x}", g.choice([1, 2, 2, 3, 4])
            self.joined[comm] = size
            self.next_seq[comm] = 1
            ranks = list(range(size))
            if size > 1 and g.random() < 0.1:
                ranks.remove(g.choice(ranks))
            return [[self.dumps({"v": s.VERSION, "type": "comm_init", "token": self.token, "req": g.randrange(1, 2**31),
                                 "comm": comm, "rank": r, "size": size, "global_rank": r, "node": 0, "host": "h0",
                                 "transport": "shm"})] for r in ranks]
        if roll < 0.3:
            return [[self.dumps(self.valid())]]  # anything well typed
        comm = g.choice(list(self.joined))
        size = self.joined[comm]
        if roll < 0.4 and size > 1:  # point-to-point: a send, its receive, or both
            src, dst = g.sample(range(size), 2)
            n = self.next_p2p.get((comm, src, dst), 1)
            self.next_p2p[(comm, src, dst)] = n + 1
            numel = g.choice([1, 16, 300])
            out = []
            for op, me, peer in (("send", src, dst), ("recv", dst, src)):
                if g.random() < 0.9:
                    out.append(self._coll(comm, op, me, n, numel, "float32", 0, peer=peer))
            return [self._framed(b, size) for b in out]
        seq = self.next_seq[comm]
        self.next_seq[comm] = seq + 1 if g.random() < 0.9 else seq + g.choice([0, 2])  # repeated, skipped
        op = g.choice([o for o in s.CollOp if o not in (s.CollOp.SEND, s.CollOp.RECV)])
        numel = g.choice([0, 1, 4, 64, 255]) * (size if op in (s.CollOp.REDUCE_SCATTER, s.CollOp.ALLTOALL) else 1)
        dtype = g.choice(["float32", "bfloat16", "int64", "bool", "uint8", "float16"])
        root = g.randrange(size)
        bodies = [self._coll(comm, op.value, r, seq, numel, dtype, root, size=size) for r in range(size)]
        if g.random() < 0.5:  # twist one field of one rank's half
            body = g.choice(bodies)
            name = g.choice(["seq", "numel", "out_numel", "root", "device", "arena", "in_off", "out_off", "dtype",
                             "op", "reduce_op", "splits", "rank"])
            fresh = self.valid(s.Collective)
            body[name] = fresh[name]
        if size > 1 and g.random() < 0.1:
            bodies.remove(g.choice(bodies))  # a rank that never comes
        g.shuffle(bodies)
        return [self._framed(b, size) for b in bodies]

    def _framed(self, body: dict, size: int) -> list[bytes]:
        """``body``'s frames: a third of the time it goes over the socket transport, with its bytes as data
        frames, mostly as many as its shape declares (to reach the kernels), sometimes too few or too many."""
        g = self.gen
        if g.random() > 0.33:
            return [self.dumps(body)]
        body.update(transport="socket", arena="")
        numel = body["numel"] if type(body["numel"]) is int and 0 <= body["numel"] < 1 << 20 else 0
        mine = body["rank"] == body["root"]
        elems = {"broadcast": numel if mine else 0, "scatter": numel * size if mine else 0, "barrier": 0,
                 "recv": 0}.get(body["op"], numel)
        dtype = DTYPES.get(body["dtype"]) if isinstance(body["dtype"], str) else None
        nbytes = elems * (dtype.itemsize if dtype is not None else 4)
        if g.random() < 0.2:
            nbytes = max(0, nbytes + g.choice([-1, 1, -4, 8, 4096]))
        data = bytes(g.randrange(256) for _ in range(min(nbytes, 64))) * (nbytes // 64 + 1)
        return [self.dumps(body)] + ([data[:nbytes]] if nbytes else [])

    def _coll(self, comm: str, op: str, rank: int, seq: int, numel: int, dtype: str, root: int, size: int = 1,
              peer: int = -1) -> dict:
        """One rank's plausible half of a collective (inputs at 0, outputs at 2048 of its own arena)."""
        g = self.gen
        out_numel = {"allgather": numel * size, "gather": numel * size if rank == root else 0,
                     "reduce_scatter": numel // size, "scatter": numel // size, "barrier": 0,
                     "reduce": numel if rank == root else 0}.get(op, numel)
        splits = [numel // size] * size if op == "alltoall" else []
        return {"v": s.VERSION, "type": "collective", "token": self.token, "req": g.randrange(1, 2**31),
                "comm": comm, "seq": seq, "rank": rank, "op": op, "reduce_op": g.choice(["sum", "max", "avg"]),
                "dtype": dtype, "numel": numel, "out_numel": out_numel, "root": root, "device": rank,
                "arena": self.real_arenas[rank % len(self.real_arenas)], "in_off": 0,
                "out_off": g.choice([0, 2048]), "site": "fuzz.py:1:<module>", "splits": splits, "peer": peer}

    # ------------------------------------------------------------ must be refused

    def refusable(self) -> list[bytes]:
        """Frames of one message the daemon must answer with exactly one ``protocol`` error."""
        g = self.gen
        kind = g.randrange(100)
        if kind < 12:  # random bytes
            return [bytes(g.randrange(256) for _ in range(g.randrange(0, 200)))]
        if kind < 24:  # a valid message cut short (always ends before its closing brace)
            raw = self.dumps(self.valid())
            return [raw[: g.randrange(len(raw))]]
        if kind < 44:  # one field of the wrong type (the real token: only the type is wrong)
            body = self.valid()
            cls = s.MESSAGE_TYPES[body["type"]]
            name = g.choice(list(_TYPES[cls]))
            kind_of = _TYPES[cls][name]
            if kind_of == "int":
                body[name] = g.choice(_INT_JUNK)
            elif kind_of == "float":
                body[name] = g.choice(_FLOAT_JUNK)
            elif kind_of == "str":
                body[name] = g.choice(_STR_JUNK)
            elif kind_of == "list":
                body[name] = g.choice(_LIST_JUNK)
            elif kind_of == "list[str]":
                body[name] = g.choice(_STR_LIST_JUNK)
            elif kind_of == "dict":
                body[name] = g.choice(_DICT_JUNK)
            else:  # enum: a value outside it
                body[name] = g.choice(["", "ALLREDUCE", "xor", 3, None, ["sum"], "sum "])
            return [self.dumps(body)]
        if kind < 56:  # a wrong, missing or ill-typed token
            body = self.valid()
            body["token"] = g.choice([
                "", "x", self.token[:-1], self.token + "0", self.token.upper() + "\u00e9", " " + self.token,
                self.token[::-1], "\ud800", None, 0, [self.token], {"t": self.token},
            ])
            if g.random() < 0.2:
                del body["token"]
            return [self.dumps(body)]
        if kind < 64:  # version and type wrong, or a reply/event sent as a request
            body = self.valid()
            which = g.randrange(5)
            if which == 0:
                body["v"] = g.choice([0, 2, -1, "1", 1.0, None, True, 2**64])
            elif which == 1:
                del body["v"]
            elif which == 2:
                body["type"] = g.choice(["", "PING", "nonsense", None, 1, ["ping"], {"t": "ping"}, "ping "])
            elif which == 3:
                del body["type"]
            else:
                body["type"] = g.choice(NOT_REQUESTS)
            return [self.dumps(body)]
        if kind < 72:  # JSON that is not one object
            return [self.dumps(g.choice([[], [self.valid()], 1, -0.0, "ping", None, True, [[[]]], "", {"": {}}]))
                    if g.random() < 0.8 else g.choice([b"NaN", b"Infinity", b"-", b"1e999", b"{}{}", b"{} x"])]
        if kind < 80:  # byte-level mutations of a message with a wrong token (whatever parses is refused)
            raw = bytearray(self.dumps(self.valid(token="not-the-token")))
            for _ in range(g.randrange(1, 4)):
                i = g.randrange(len(raw))
                op = g.randrange(3)
                if op == 0:
                    raw[i] = g.randrange(256)
                elif op == 1:
                    del raw[i]
                else:
                    raw.insert(i, g.randrange(256))
            return [bytes(raw)]
        if kind < 83:  # several frames in one message
            return [self.dumps(self.valid()) if g.random() < 0.5 else b"" for _ in range(g.randrange(2, 5))]
        if kind < 86:  # a socket-transport collective whose data frames are cut wrong (not full, or empty)
            body = self.valid(s.Collective)
            body["transport"] = "socket"
            cuts = g.choice([[b"\0" * g.randrange(1, 100), b"\0" * 4], [b""], [b"\0" * 4, b""], [b""] * 3])
            return [self.dumps(body), *cuts]
        if kind < 90:  # strings that JSON allows and Python dislikes, with a wrong token
            body = self.valid(token=g.choice(["\ud800", "\udfff\ud800", "\u0000" * 10, "\uffff"]))
            return [self.dumps(body)]
        if kind < 94:  # duplicate keys: the last one (a wrong token) wins
            raw = self.dumps(self.valid())
            return [raw[:-1] + b',"token":"dup"}']
        if kind < 97 or not self.big:  # huge and non-finite numbers
            body = self.valid(token="bad")
            return [self.dumps(body).replace(b'"req":', b'"req":1e999,"x":', 1)]
        if kind < 99:  # deep nesting, short or long
            depth = g.choice([50, 1000, 100_000])
            return [b"[" * depth + b"]" * depth if g.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth]
        # oversized: past MAX_MESSAGE_BYTES (1 MiB), under the transport's frame limit
        body = self.valid()
        body["site"] = "s" * (s.MAX_MESSAGE_BYTES + g.randrange(1, 1 << 20))
        return [self.dumps(body)]
