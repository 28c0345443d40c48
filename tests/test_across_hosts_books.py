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
