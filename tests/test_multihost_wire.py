"""What crosses the network in a multi-host run, checked on one machine without Slurm.

The daemon's TCP endpoint and the session's agent bus are real sockets here: a
client that does not speak CURVE with the server's key gets nothing, a CURVE
client without the session token is refused, and malformed agent messages are
ignored. The whole multi-host run (srun, agents, ranks on other hosts) is in
tests/multihost/test_mirage_slurm.py.
"""

import os
import signal

import numpy as np
import pytest
import zmq
from daemon_client import DaemonProcess, stamped
from test_cli_usage import mirage

from mirage_tui.config.topology import UsageError
from mirage_tui.hosts import netif
from mirage_tui.hosts import protocol as ap
from mirage_tui.hosts.head import Hosts
from wire import kineto_trace
from wire import schema as s
from wire.endpoints import TCP_ENDPOINT_FILE


@pytest.fixture(scope="module")
def tcp_daemon():
    d = DaemonProcess(listen="127.0.0.1")
    try:
        with open(os.path.join(d.run_dir, TCP_ENDPOINT_FILE)) as f:
            d.tcp = f.read().strip()
        yield d
    finally:
        d.stop()


def _dealer(ctx: zmq.Context, endpoint: str, server_key: str | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    return sock


def test_the_daemon_listens_on_the_chosen_address_only(tcp_daemon):
    assert tcp_daemon.tcp.startswith("tcp://127.0.0.1:")


def test_over_tcp_only_curve_with_the_token_is_answered(tcp_daemon):
    ctx = zmq.Context()
    try:
        plain = _dealer(ctx, tcp_daemon.tcp, None)  # no CURVE: the handshake fails, nothing is read
        plain.send(stamped(s.Ping(), tcp_daemon.token, 1))
        assert not plain.poll(1000)
        wrong_key = _dealer(ctx, tcp_daemon.tcp, zmq.curve_keypair()[0].decode())  # a server it is not
        wrong_key.send(stamped(s.Ping(), tcp_daemon.token, 1))
        assert not wrong_key.poll(1000)
        no_token = _dealer(ctx, tcp_daemon.tcp, tcp_daemon.server_key)
        no_token.send(stamped(s.Ping(), "not-the-token", 1))
        assert no_token.poll(5000)
        reply = s.decode(no_token.recv())
        assert isinstance(reply, s.Error) and "unauthorized" in reply.message
        ok = _dealer(ctx, tcp_daemon.tcp, tcp_daemon.server_key)
        ok.send(stamped(s.Ping(), tcp_daemon.token, 7))
        assert ok.poll(5000) and s.decode(ok.recv()) == s.Ok(req=7)
    finally:
        ctx.destroy(linger=0)
    assert tcp_daemon.alive()  # the ipc endpoint still works, without CURVE


def test_full_data_frames_cross_curve(tcp_daemon):
    """A 32 MiB all-reduce over TCP: two full data frames, each a little bigger once encrypted."""
    numel = 2 * s.MAX_DATA_FRAME_BYTES // 4
    data = np.arange(numel, dtype=np.float32)
    ctx = zmq.Context()
    try:
        rank = _dealer(ctx, tcp_daemon.tcp, tcp_daemon.server_key)
        rank.send(stamped(s.CommInit(comm="f" * 32, rank=0, size=1, global_rank=0, transport="socket"),
                          tcp_daemon.token, 1))
        assert rank.poll(5000) and s.decode(rank.recv()) == s.Ok(req=1)
        frames = [data[i:i + numel // 2].tobytes() for i in (0, numel // 2)]
        coll = s.Collective(comm="f" * 32, seq=1, rank=0, numel=numel, out_numel=numel, transport=s.Transport.SOCKET)
        rank.send_multipart([stamped(coll, tcp_daemon.token, 2), *frames])
        assert rank.poll(20000), "no answer: the connection was dropped"
        reply, out = rank.recv_multipart()
        assert isinstance(s.decode(reply), s.Done)
        np.testing.assert_array_equal(np.frombuffer(out, np.float32), data)
    finally:
        ctx.destroy(linger=0)


def test_another_hosts_rank_is_watched_by_its_agent_not_by_pid(tcp_daemon):
    """A rank registered from another host is not checked by pid here: it is gone when its agent says so."""
    c = tcp_daemon.client()
    events = tcp_daemon.ctx.socket(zmq.SUB)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    events.connect(tcp_daemon.events_endpoint)

    def gone_within(seconds: float) -> list:
        seen = []
        while events.poll(seconds * 1000):
            seen += [e for e in s.decode_events(events.recv()) if isinstance(e, s.RankGone)]
            if seen:
                break
        return seen

    try:
        # no such pid on this machine: checked here, the rank would be gone within the daemon's 20 ms scan
        assert isinstance(c.call(s.Hello(rank=5, node=1, pid=999_999, host="elsewhere")), s.Ok)
        assert gone_within(1.0) == []
        assert isinstance(c.call(s.RankExited(rank=5, pid=999_999, host="elsewhere")), s.Ok)
        (gone,) = gone_within(5.0)
        assert (gone.rank, gone.pid) == (5, 999_999)
    finally:
        events.close(0)


# ---------------------------------------------------------------- the agents' bus


@pytest.fixture
def bus(tmp_path):
    public, secret = zmq.curve_keypair()
    got: list = []
    hosts = Hosts("127.0.0.1", secret, "the-token", "sess", str(tmp_path), lambda e, line: got.append(e),
                  lambda *a: got.append(a))
    hosts.public = public.decode()
    hosts.got = got
    yield hosts
    hosts.ctx.destroy(linger=0)


def _pump(hosts: Hosts, until, tries: int = 50) -> None:
    for _ in range(tries):
        if hosts.sock.poll(100):
            hosts._receive()
        if until():
            return


def test_the_bus_takes_an_agent_only_with_the_token(bus):
    ctx = zmq.Context()
    try:
        intruder = _dealer(ctx, bus.endpoint, bus.public)
        intruder.send(ap.encode(ap.AgentHello(token="guess", host="evil")))
        intruder.send(b"\xff not json")
        intruder.send(b'{"type": "output", "lines": "not a list"}')
        agent = _dealer(ctx, bus.endpoint, bus.public)
        agent.send(ap.encode(ap.AgentHello(token="the-token", host="h1", address="10.0.0.1", slurm_node=0)))
        _pump(bus, lambda: len(bus.agents) == 1 and bus.ignored >= 3)
        assert [a.host for a in bus.agents.values()] == ["h1"]
        assert bus.ignored == 3
        # the intruder's later messages are still not taken for an agent's
        intruder.send(ap.encode(ap.Output(lines=[s.encode(s.OutputLine(rank=0, text="forged")).decode()])))
        agent.send(ap.encode(ap.Output(lines=[s.encode(s.OutputLine(rank=0, text="real")).decode(),
                                              s.encode(s.RankGone(rank=0, pid=1)).decode()])))
        _pump(bus, lambda: bus.got)
        assert [e.text for e in bus.got] == ["real"]  # and an agent relays output lines only
    finally:
        ctx.destroy(linger=0)


def test_a_host_daemon_s_events_are_taken_for_its_communicators_only(bus):
    ctx = zmq.Context()
    try:
        agent = _dealer(ctx, bus.endpoint, bus.public)
        agent.send(ap.encode(ap.AgentHello(token="the-token", host="h2", slurm_node=1)))
        joined = s.CommJoined(comm="c", rank=0, size=2, global_rank=2, transport="shm")
        hang = s.HangDetected(comm="c", seq=1, joined=[2], missing=[3], waited_s=3.0)
        # the ranks themselves are the head's daemon's to report: a host's daemon must not add them twice
        head_only = [s.RankRegistered(rank=2, node=1, pid=7, host="h2"), s.RankGone(rank=2, pid=7),
                     s.DaemonReady(pid=1), s.OutputLine(rank=2, text="not the daemon's")]
        agent.send(ap.encode(ap.DaemonEvents(lines=[s.encode(e).decode() for e in (joined, *head_only, hang)])))
        _pump(bus, lambda: len(bus.got) >= 2 and bus.ignored >= 4)
        assert bus.got == [joined, hang] and bus.ignored == 4
    finally:
        ctx.destroy(linger=0)


def test_an_agent_s_traces_land_in_the_run_directory_whole_or_not_at_all(bus, tmp_path):
    ctx = zmq.Context()
    try:
        agent = _dealer(ctx, bus.endpoint, bus.public)
        agent.send(ap.encode(ap.AgentHello(token="the-token", host="h2", slurm_node=1)))
        for msg in (ap.TraceFile(name="rank-2.json", part=0, data='{"traceEvents": '),
                    ap.TraceFile(name="rank-2.json", part=1, data="[]}", last=True),
                    ap.TraceFile(name="rank-3.json", part=0, data='{"traceEvents": '),  # its host died here
                    ap.TraceFile(name="../evil.json", part=0, data="x", last=True),
                    ap.TraceFile(name="rank-4.json", part=1, data="x", last=True),  # no part 0
                    ap.Finished()):
            agent.send(ap.encode(msg))
        _pump(bus, lambda: any(a.finished for a in bus.agents.values()))
        assert bus.ignored == 2
        traces = tmp_path / "traces"
        assert (traces / "rank-2.json").read_text() == '{"traceEvents": []}'
        assert sorted(p.name for p in traces.iterdir()) == ["rank-2.json", "rank-3.json.part"]
        assert not (tmp_path / "evil.json").exists()
        assert kineto_trace.rank_traces(str(traces)) == [(2, "rank-2.json")]  # what the merge reads
    finally:
        ctx.destroy(linger=0)


def test_a_silent_agent_is_a_lost_host(bus):
    ctx = zmq.Context()
    try:
        agent = _dealer(ctx, bus.endpoint, bus.public)
        agent.send(ap.encode(ap.AgentHello(token="the-token", host="h2", slurm_node=1)))
        _pump(bus, lambda: bus.agents)
        (a,) = bus.agents.values()
        (proc,) = bus.launch(a, ["true"], None, [ap.Process(node=1, rank=None, env={})])
        bus.watch("h2", 3, 4242)
        a.heard -= ap.SILENCE_S + 1
        bus._check_silence()
        assert proc.poll() == -signal.SIGKILL
        lost = [e for e in bus.got if isinstance(e, s.HostLost)]
        assert [(e.host, e.nodes, e.ranks) for e in lost] == [("h2", [1], [3])]
        assert ("h2", 3, 4242) in bus.got  # the daemon hears the rank is gone
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("data", [
    b"[]", b'{"v": 1, "type": "launch", "processes": [{"node": "0", "rank": null, "env": {}}]}',
    b'{"v": 1, "type": "launch", "processes": [{"node": 0, "rank": null, "env": {"A": 1}}]}',
    b'{"v": 1, "type": "launch", "processes": [{"node": 0, "env": {}}]}',
    b'{"v": 1, "type": "kill", "index": "all"}', b'{"v": 1, "type": "kill", "index": true}',
    b'{"v": 1, "type": "dump_stacks", "ranks": {"0": "pid"}}', b'{"v": 1, "type": "nope"}', b'{"v": 1, "type": "trace", "name": "rank-0.json", "last": 1}',
    b'{"type": "done"}', b'{"v": 1, "type": "ping"}',  # no version; the daemon's message, not an agent's
])
def test_malformed_agent_messages_are_refused(data):
    with pytest.raises(s.SchemaError):
        ap.decode(data)


def test_the_daemon_takes_no_agent_message():
    with pytest.raises(s.SchemaError, match="unknown message type 'launch'"):
        s.decode(ap.encode(ap.Launch(command=["sh"])))


def test_agent_messages_round_trip():
    for msg in (ap.AgentHello(token="t", host="h", address="1.2.3.4", slurm_node=2, pid=3, master_port=4),
                ap.Launch(command=["python", "x.py"], workdir="/w",
                          processes=[ap.Process(0, None, {"A": "1"}), ap.Process(1, 3, {})]),
                ap.Stacks(req=1, ranks={"0": ["sleeping", "File x"]}), ap.Kill(index=-1, signal=9),
                ap.DumpStacks(req=2, ranks={"1": 55}), ap.Exited(index=0, pid=9, returncode=-9), ap.Done(),
                ap.TraceFile(name="rank-1.json", part=2, data="{}", last=True)):
        assert ap.decode(ap.encode(msg)) == msg


def test_the_interface_is_chosen_as_nccl_reads_its_variable():
    assert netif._matches("eth0", "eth") and not netif._matches("eth0", "^eth")
    assert netif._matches("eth0", "=eth0") and not netif._matches("eth01", "=eth0")
    assert netif._matches("ib0", "eth,ib") and netif._matches("br0", "^docker,lo")
    assert netif.choose("lo") == ("lo", "127.0.0.1")
    with pytest.raises(UsageError, match="NCCL_SOCKET_IFNAME=nosuchif"):
        netif.choose("nosuchif")


@pytest.mark.parametrize("env, args, message", [
    ({}, [], "--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is not set): run it under salloc"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}, ["--num-nodes", "3"],
     "--num-nodes 3 cannot be spread evenly over the allocation's 2 hosts; give a multiple of 2"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}, ["--debug-rank", "0"],
     "--debug-rank listens on the rank's loopback, out of reach on another host"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"}, ["--in-process"],
     "--launcher slurm runs nodes on other hosts, and --in-process runs one process here"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "NCCL_SOCKET_IFNAME": "=nosuch0"}, [],
     "no network interface that is up with an IPv4 address matches NCCL_SOCKET_IFNAME==nosuch0"),
])
def test_slurm_usage_errors_are_one_line(tmp_path, monkeypatch, env, args, message):
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    r = mirage(tmp_path, "run", "--launcher", "slurm", *args, "--", "true")
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert message in line and line.startswith("mirage: error: ")
    assert not (tmp_path / ".mirage").exists()  # nothing was started
