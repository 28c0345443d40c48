"""A communicator across hosts, as the head's daemon and a daemon without peer links see it.

The head's daemon keeps the books of an all-reduce whose data goes host daemon to
host daemon (``Transport.HOSTS``): it matches and publishes it and answers only an
error, and ranks disagreeing on the path hear of it. A daemon that was started
without ``--peer-listen`` refuses a share of such a communicator, naming why.
(The data path itself, between hosts' daemons, runs in the multihost set:
tests/multihost/test_mirage_slurm.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from daemon_client import Events

from wire import schema as s

C = s.CollOp


def _books(g, numel=4, **kw):
    return [r.post(C.ALLREDUCE, numel, out_numel=numel, transport=s.Transport.HOSTS, **kw) for r in g.ranks]


def test_the_books_of_an_all_reduce_across_hosts_are_kept_and_published_but_not_answered(daemon):
    ev = Events(daemon)
    g = daemon.group(2, hosts=["h1", "h2"])
    g.run(C.BARRIER, None)
    _books(g)
    seen = ev.until(lambda e: isinstance(e, s.CollectiveCompleted) and e.comm == g.comm and e.seq == 2)
    enqueued = [e for e in seen if isinstance(e, s.CollectiveEnqueued) and e.comm == g.comm and e.seq == 2]
    assert [e.transport for e in enqueued] == [s.Transport.HOSTS] * 2
    assert not g.ranks[0].client.has_reply(0.3)  # nobody is answered: the data went elsewhere
    assert g.run(C.ALLREDUCE, [np.ones(2, np.float32)] * 2)[0].tolist() == [2.0, 2.0]  # seq 3 matches next
    ev.close()


def test_ranks_disagreeing_on_whether_it_goes_host_to_host_all_hear_it(daemon):
    g = daemon.group(2, hosts=["h1", "h2"])
    g.run(C.BARRIER, None)
    for r in g.ranks:
        r.ensure_arena(64)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4, transport=s.Transport.HOSTS)
    g.ranks[1].post(C.ALLREDUCE, 4, out_numel=4)
    for rep in g.replies():
        assert isinstance(rep, s.Error) and rep.code == "ncclInvalidUsage", rep
        assert "host daemon to host daemon" in rep.message


def test_the_books_wait_for_every_rank_as_for_any_collective(daemon):
    ev = Events(daemon)
    g = daemon.group(2, hosts=["h1", "h2"])
    g.run(C.BARRIER, None)
    g.ranks[0].post(C.ALLREDUCE, 4, out_numel=4, transport=s.Transport.HOSTS)
    seen = ev.until(lambda e: isinstance(e, s.CollectiveEnqueued) and e.comm == g.comm and e.seq == 2)
    assert not any(isinstance(e, s.CollectiveCompleted) and e.comm == g.comm and e.seq == 2 for e in seen)
    ev.close()


@pytest.mark.parametrize("msg", [
    s.CommInit(comm="c", rank=0, size=1, host="h1", hosts=["h1", "h2"]),
    s.PeerDirectory(peers={"h2": ["tcp://10.0.0.2:1", "aegis256"]}, key="00" * 32),
])
def test_a_daemon_without_peer_links_refuses_a_share_across_hosts(daemon, msg):
    rep = daemon.client().call(msg)
    assert isinstance(rep, s.Error) and rep.code == "ncclInvalidUsage", rep
    assert "links" in rep.message or "peer" in rep.message



_THRESHOLD = r"""
import dataclasses
from types import SimpleNamespace

import torch

from shim.rank.runtime import RUNTIME
from shim.transport.across_hosts import AcrossHostsTransport
from wire import schema as s

def takes(numel, dtype=torch.float32, op=s.CollOp.ALLREDUCE, seq=3, out_numel=None):
    transport = SimpleNamespace(comm=SimpleNamespace(seq=seq))
    call = SimpleNamespace(op=op, reduce_op=s.ReduceOp.SUM, staged_numel=numel, dtype=dtype,
                           out_numel=numel if out_numel is None else out_numel)
    return AcrossHostsTransport.takes(transport, call)

assert RUNTIME.settings.across_hosts_min_bytes == 256 << 10
assert takes(64 << 10) and takes(128 << 10, torch.bfloat16)  # 256 KiB
assert not takes((64 << 10) - 1) and not takes(1000)
assert not takes(1 << 20, seq=0) and not takes(1 << 20, op=s.CollOp.ALLTOALL)
# an all-gather by its output, a reduce-scatter by its input: every rank measures the same collective
assert takes(16 << 10, op=s.CollOp.ALLGATHER, out_numel=64 << 10)
assert takes(64 << 10, op=s.CollOp.REDUCE_SCATTER, out_numel=16 << 10)
assert not takes(16 << 10, op=s.CollOp.ALLGATHER, out_numel=32 << 10)
assert takes(1 << 20, op=s.CollOp.BROADCAST)
RUNTIME.settings = dataclasses.replace(RUNTIME.settings, across_hosts_min_bytes=0)
assert takes(1) and not takes(0)
print("threshold ok")
"""


def test_collectives_under_the_size_threshold_keep_the_head_path(tmp_path):
    """Which calls a rank sends host daemon to host daemon: all-reduces, reduce-scatters, all-gathers and
    broadcasts from MIRAGE_ACROSS_HOSTS_MIN_BYTES (256 KiB by default; the head's one round trip costs less below
    it), never a communicator's first collective."""
    from tests.test_run import mirage_run

    r = mirage_run(tmp_path, "--in-process", "--", "python", "-c", _THRESHOLD)
    assert r.returncode == 0 and "[0] threshold ok" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
