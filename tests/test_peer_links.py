"""Host daemons' peer links, in process: two daemons' links on the loopback, sealed with the run's key.

What one sends, the other opens; a message sealed under another run's key, one
replayed, one altered or one without the session token is dropped and said.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from emulator.peer_links import PeerLinks
from emulator.peer_seal import Seals, SealError, best_cipher
from wire import peers as p

KEY = bytes(range(32))


def _pair(ctx, key_b: bytes = KEY):
    a, b = PeerLinks(ctx, "ha", "tok", "127.0.0.1"), PeerLinks(ctx, "hb", "tok", "127.0.0.1")
    directory = {"ha": [a.endpoint, a.cipher.name], "hb": [b.endpoint, b.cipher.name]}
    a.link(directory, KEY)
    b.link(directory, key_b)
    return a, b


def _receive(links: PeerLinks, want: int, timeout_s: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        links.router.poll(50)
        got += links.receive()
    return got


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_a_chunk_and_a_beat_arrive_sealed_and_open(ctx):
    a, b = _pair(ctx)
    x = np.arange(1000, dtype=np.float32)
    a.send("hb", p.PeerChunk(comm="c", seq=1, numel=1000, at=0, count=1000), x)
    a.beat(time.monotonic())
    got = _receive(b, 2)
    assert [type(m) for m, _ in got] == [p.PeerChunk, p.PeerBeat]
    assert got[0][0].host == "ha" and np.array_equal(got[0][1].open().view(np.float32), x)
    assert (a.sent_bytes, b.received_bytes, b.refused) == (4000, 4000, 0)
    assert b.silent_for("ha", time.monotonic()) < 1.0


def test_another_run_s_key_a_replay_a_change_or_no_token_is_dropped(ctx, capfd):
    a, b = _pair(ctx, key_b=bytes(32))  # b seals and opens with another key
    a.send("hb", p.PeerBeat())
    assert _receive(b, 1, timeout_s=0.5) == [] and b.refused == 1
    seals = Seals(best_cipher(), "ha", KEY)
    frames = seals.seal("hb", b'{"v":1,"type":"beat","token":"tok","host":"ha"}')
    opener = Seals(best_cipher(), "hb", KEY)
    assert opener.open(frames)[0] == "ha"
    with pytest.raises(SealError, match="replayed"):
        opener.open(frames)
    altered = seals.seal("hb", b'{"v":1,"type":"beat","token":"tok","host":"ha"}')
    altered[1][0] ^= 1
    with pytest.raises(SealError, match="does not open"):
        opener.open(altered)
    c, d = _pair(ctx)
    c.token = "not the session's"
    c.send("hb", p.PeerBeat())
    assert _receive(d, 1, timeout_s=0.5) == [] and d.refused == 1
    assert "dropped peer message" in capfd.readouterr().err
