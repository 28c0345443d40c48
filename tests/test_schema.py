"""The wire codec's fast paths (generated per message class) write and read exactly what the generic ones do."""

from __future__ import annotations

import dataclasses
import json

import pytest

from wire import codec
from wire import schema as s

#: values of every JSON kind (and some a field's type refuses), put in each field of each message
ODD_VALUES = ["h\u00e9\"llo\\\n\ud800{}'", "", 7, -1, 2**70, 0, True, False, 1.5, -0.0, 1e300, float("nan"),
              float("inf"), [1, 2], [], ["a"], [True], None, {"a": 1}, "allreduce", s.CollOp.BROADCAST]


def _generic_encode(msg: s.Message, **fields) -> bytes:
    return json.JSONEncoder(separators=(",", ":")).encode({"v": s.VERSION, "type": msg.TYPE, **msg.__dict__,
                                                           **fields}).encode()


def _generic_decode(data: bytes | str) -> s.Message:
    """decode's field-by-field path, which the generated decoders must agree with."""
    body = codec._DECODER.decode(data.decode() if isinstance(data, bytes) else data)
    cls = s.MESSAGE_TYPES[body["type"]]
    values = {}
    for name, check in codec._fields(cls):
        if name in body:
            values[name] = check(body[name])
    return cls(**values)


@pytest.mark.parametrize("cls", sorted(s.MESSAGE_TYPES.values(), key=lambda c: c.TYPE), ids=lambda c: c.TYPE)
def test_fast_codec_matches_generic(cls):
    base = cls()
    assert list(base.__dict__) == [f.name for f in dataclasses.fields(cls)]  # the fast __init__'s order
    assert s.encode(base) == _generic_encode(base)
    assert s.decode(s.encode(base)) == base
    for f in dataclasses.fields(cls):
        for value in ODD_VALUES:
            msg = dataclasses.replace(base, **{f.name: value})
            try:
                want = _generic_encode(msg)
            except (TypeError, ValueError):
                with pytest.raises((TypeError, ValueError)):
                    s.encode(msg)
                continue
            assert s.encode(msg) == want, (f.name, value)
            try:
                expected = _generic_decode(want)
            except (s.SchemaError, ValueError):
                with pytest.raises(s.SchemaError):
                    s.decode(want)
                continue
            got = s.decode(want)
            assert got == expected and type(got) is cls, (f.name, value)
            assert [type(v) for v in got.__dict__.values()] == [type(v) for v in expected.__dict__.values()]
            assert list(got.__dict__) == list(expected.__dict__)
        body = json.loads(s.encode(base))
        del body[f.name]  # a missing field takes its default
        if f.name != "t":  # (an event's default time is the time it is made)
            assert s.decode(json.dumps(body)) == base
    assert s.decode(json.dumps({**json.loads(s.encode(base)), "unknown": 1})) == base
    if issubclass(cls, s.Request):  # a request's token and id go in as fields
        assert s.encode(base, token="t\u00e9", req=9) == _generic_encode(base, token="t\u00e9", req=9)


def test_messages_keep_dataclass_behaviour():
    c = s.Collective("tok", 3, "comm")  # positional, in field order
    assert (c.token, c.req, c.comm, c.splits) == ("tok", 3, "comm", [])
    c.splits.append(1)
    assert s.Collective().splits == []  # a fresh default per message
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seq = 4
    with pytest.raises(TypeError):
        s.Collective(nonsense=1)
    assert dataclasses.replace(c, seq=5).seq == 5
    first, second = s.CollectiveCompleted(), s.CollectiveCompleted()
    assert first.t <= second.t


@pytest.mark.parametrize("data", [b' {"v":1,"type":"ok"} ', b'{"v":1,"type":"ok"}{"v":1}', b'{"v":1,"type":"ok"} x',
                                  b"", b"nul", b"[1]", b'"x"', b'{"v":1,"type":"ok","req":NaN}',
                                  b'{"v":1,"type":"ok","req":1e999}', b"\xff", b'{"v":1,"type":"ok"'])
def test_decode_refuses_or_accepts_as_the_json_module_does(data):
    try:
        body = codec._DECODER.decode(data.decode())
    except (ValueError, UnicodeDecodeError):
        with pytest.raises(s.SchemaError, match="not JSON"):
            s.decode(data)
        return
    if isinstance(body, dict):
        assert s.decode(data) == s.Ok()
    else:
        with pytest.raises(s.SchemaError, match="JSON object"):
            s.decode(data)


def test_daemon_enqueued_template_writes_the_event_line(tmp_path):
    """The daemon's per-call-site template for coll_enqueued writes what encoding the event would."""
    import time

    from emulator.daemon import Daemon

    daemon = Daemon(str(tmp_path), "abcdef123456", "tok", "mi300x", 1, 8)
    try:
        for site in ["/x/train.py:10:main", 'we"ird "t":1.5, ,"seq":123456789, \u00e9 \ud800', ""]:
            for seq in (1, 2, 10**12):
                req = s.Collective(comm="c" * 32, seq=seq, rank=1, op=s.CollOp.ALLGATHER, dtype="bfloat16", numel=7,
                                   device=3, site=site, transport=s.Transport.SOCKET)
                daemon.events.publish_enqueued(req)
                line = daemon.events._fresh.pop()
                event = s.decode(line)
                assert abs(event.t - time.time()) < 5
                assert line == s.encode(s.CollectiveEnqueued(
                    t=event.t, comm=req.comm, seq=seq, rank=1, op=req.op, dtype=req.dtype, numel=7, device=3,
                    site=site, transport=req.transport,
                ))
    finally:
        daemon.close()
