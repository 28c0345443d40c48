"""The collective cost model is self-consistent and reproduces published rccl-tests figures."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from wire.collective_cost import (
    BASE_LATENCY_US,
    NIC_EFFICIENCY,
    PROTOCOL_BW_FRACTION,
    RING_PLATEAU_LATENCY_FACTOR,
    XGMI_EFFICIENCY,
    XGMI_HOP_US,
    Algorithm,
    Collective,
    Protocol,
    bus_factor,
    candidates,
    estimate,
)
from wire.profiles import load_profile

MI300X = load_profile("mi300x")
MIB, GIB = 2**20, 2**30
BENCH = Path(__file__).resolve().parent.parent / "bench" / "clocked_collectives.py"


def _bench():
    spec = importlib.util.spec_from_file_location("clocked_collectives", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("op", list(Collective))
def test_twice_the_bytes_of_a_bandwidth_bound_collective_takes_twice_the_time(op):
    one, two = (estimate(op, n, 8, MI300X) for n in (GIB, 2 * GIB))
    assert two.seconds == pytest.approx(2 * one.seconds, rel=0.01)
    # and the bandwidth term is exactly linear
    assert two.seconds - two.latency_s == pytest.approx(2 * (one.seconds - one.latency_s))


@pytest.mark.parametrize("nbytes", [8, 1024, 16384, 65536])
def test_latency_bound_all_reduce_sits_at_rccls_small_message_latency(nbytes):
    est = estimate("all_reduce", nbytes, 8, MI300X)
    # rccl-tests on 8 x MI300X: about 13 us from 1 to 64 KB (../shared/REFERENCE.md)
    assert est.seconds == pytest.approx(13e-6, rel=0.1)
    assert (est.algorithm, est.protocol) == (Algorithm.RING, Protocol.LL)


def test_more_ranks_on_a_ring_cost_what_the_formula_says():
    nbytes = 256 * MIB
    for n in (2, 4, 8):
        est = estimate("all_reduce", nbytes, n, MI300X)
        assert (est.algorithm, est.protocol) == (Algorithm.RING, Protocol.SIMPLE)
        links = n - 1  # fully connected: one xGMI link per peer
        bus = links * MI300X.xgmi_gbps_per_link * XGMI_EFFICIENCY
        latency_us = BASE_LATENCY_US[Protocol.SIMPLE] + 2 * (n - 1) * XGMI_HOP_US[(Algorithm.RING, Protocol.SIMPLE)]
        assert est.bus_gbps == pytest.approx(bus)
        assert est.latency_s == pytest.approx(latency_us * 1e-6)
        assert est.seconds == pytest.approx(latency_us * 1e-6 + nbytes * 2 * (n - 1) / n / (bus * 1e9))


def test_bus_factors_are_rccl_tests():
    assert bus_factor(Collective.ALL_REDUCE, 8) == 2 * 7 / 8
    assert bus_factor(Collective.ALL_GATHER, 8) == bus_factor(Collective.REDUCE_SCATTER, 8) == 7 / 8
    assert bus_factor(Collective.BROADCAST, 8) == bus_factor(Collective.SEND_RECV, 2) == 1.0


@pytest.mark.parametrize("op", [c for c in Collective if c is not Collective.SEND_RECV])
@pytest.mark.parametrize("nbytes", [4096, 4 * MIB, GIB])
def test_cross_node_is_slower_than_intra_node(op, nbytes):
    inside = estimate(op, nbytes, 8, MI300X)
    across = estimate(op, nbytes, 8, MI300X, ranks_per_node=4)
    assert across.nodes == 2 and across.seconds > inside.seconds


def test_send_recv_across_nodes_pays_the_nic_latency():
    # One achieved xGMI link (~45 GB/s) and a 400 Gb/s NIC (~46 GB/s) carry about the same:
    # what crossing nodes adds to a point-to-point transfer is latency.
    inside = estimate("send_recv", 64 * MIB, 2, MI300X)
    across = estimate("send_recv", 64 * MIB, 2, MI300X, ranks_per_node=1)
    assert inside.bus_gbps == pytest.approx(MI300X.xgmi_gbps_per_link * XGMI_EFFICIENCY)
    assert across.bus_gbps == pytest.approx(MI300X.nic_gbps / 8 * NIC_EFFICIENCY)
    assert across.latency_s > inside.latency_s
    small_inside, small_across = (estimate("send_recv", 4096, 2, MI300X, ppn) for ppn in (2, 1))
    assert small_across.seconds > small_inside.seconds


@pytest.mark.parametrize("op", list(Collective))
def test_time_grows_with_size_across_protocol_switches(op):
    # inside a node the model picks the protocol by cost: time never drops, LL turns to Simple once
    sizes = [round(2 ** (k / 4)) for k in range(0, 4 * 34 + 1)]
    ests = [estimate(op, n, 8, MI300X) for n in sizes]
    assert all(a.seconds <= b.seconds for a, b in zip(ests, ests[1:]))
    protos = [e.protocol for e in ests]
    first_simple = protos.index(Protocol.SIMPLE)
    assert set(protos[:first_simple]) == {Protocol.LL} and set(protos[first_simple:]) == {Protocol.SIMPLE}


@pytest.mark.parametrize("op", list(Collective))
@pytest.mark.parametrize(("profile", "ranks_per_node"), [("mi300x", 4), ("mi300x", 1), ("mi300x", 8), ("mi350x", 8)])
def test_across_nodes_the_protocol_follows_rccls_size_ranges_and_time_grows_within_each(op, profile, ranks_per_node):
    # Across nodes RCCL sets the protocol by bytes per rank (rcclUpdateCollectiveProtocol): LL, LL128 where
    # the platform enables it, then Simple, each once; within one protocol time never drops. At a switch it
    # may: RCCL's bounds were tuned on hardware, not on this model's constants. Below one byte per rank
    # RCCL's integer division gives 0 bytes, which no range holds: Simple.
    prof = load_profile(profile)
    ranks = 2 * ranks_per_node if ranks_per_node > 1 else 8
    sizes = [round(2 ** (k / 4)) for k in range(4 * (ranks - 1).bit_length(), 4 * 34 + 1)]  # a byte per rank up
    ests = [estimate(op, n, ranks, prof, ranks_per_node) for n in sizes]
    runs = [ests[0].protocol]
    for a, b in zip(ests, ests[1:]):
        if a.protocol is b.protocol:
            assert a.seconds <= b.seconds, (a.nbytes, b.nbytes, a.protocol)
        else:
            runs.append(b.protocol)
    if op in (Collective.ALL_TO_ALL, Collective.SEND_RECV):
        assert runs == [Protocol.LL, Protocol.SIMPLE]  # RCCL's p2p threshold, not the ranges
    elif ranks_per_node == 8:
        assert runs == [Protocol.LL, Protocol.LL128, Protocol.SIMPLE]
    else:
        assert runs == [Protocol.LL, Protocol.SIMPLE]


def test_tree_wins_small_all_reduce_across_many_nodes():
    est = estimate("all_reduce", 4096, 64, MI300X, ranks_per_node=8)
    assert est.algorithm is Algorithm.TREE
    assert estimate("all_reduce", GIB, 64, MI300X, ranks_per_node=8).algorithm is Algorithm.RING


def test_ll128_only_where_rccl_enables_it():
    # inside a node: gfx90a by cost (its Rome models set ll128Enabled), never gfx942 nor gfx950
    mi250_like = dataclasses.replace(MI300X, gfx="gfx90a")
    assert Protocol.LL128 in {e.protocol for e in candidates("all_reduce", MIB, 8, mi250_like)}
    for prof in (MI300X, load_profile("mi350x")):
        for n in (64 * 2**10, MIB, 4 * MIB, 32 * MIB, GIB):
            assert Protocol.LL128 not in {e.protocol for e in candidates("all_reduce", n, 8, prof)}
            assert estimate("all_gather", n, 8, prof).protocol is not Protocol.LL128
    # across nodes only on the 8-GPU, 8-NIC layout RCCL's Rome models enable it for (81, 89)
    mi350 = load_profile("mi350x")
    assert estimate("all_reduce", 32 * MIB, 16, mi350, 8).protocol is Protocol.LL128
    assert estimate("all_reduce", 32 * MIB, 8, mi350, 4).protocol is Protocol.SIMPLE
    sixteen_nics = dataclasses.replace(mi350, nics_per_node=16)
    assert estimate("all_reduce", 32 * MIB, 16, sixteen_nics, 8).protocol is Protocol.SIMPLE


@pytest.mark.parametrize(
    ("profile", "nodes", "nbytes", "protocol"),
    [
        # gfx950, tuning_model_6 all_reduce: LL to 256 KiB, LL128 to 32 MiB (#9406), Simple past it
        ("mi350x", 2, 64 * 2**10, Protocol.LL),
        ("mi350x", 2, 256 * 2**10, Protocol.LL),
        ("mi350x", 2, 256 * 2**10 + 4, Protocol.LL128),
        ("mi350x", 2, 16 * MIB, Protocol.LL128),
        ("mi350x", 2, 32 * MIB, Protocol.LL128),
        ("mi350x", 2, 32 * MIB + 4, Protocol.SIMPLE),
        ("mi350x", 2, 64 * MIB, Protocol.SIMPLE),
        ("mi350x", 2, 128 * MIB, Protocol.SIMPLE),
        # past two nodes RCCL scales the LL128 bound by 3.8
        ("mi350x", 4, 64 * MIB, Protocol.LL128),
        ("mi350x", 4, 128 * MIB, Protocol.SIMPLE),
        # gfx942, tuning_model_5 all_reduce: LL to 512 KiB, LL128 to 4415057 B, Simple past it
        ("mi300x", 2, 512 * 2**10, Protocol.LL),
        ("mi300x", 2, MIB, Protocol.LL128),
        ("mi300x", 2, 4 * MIB, Protocol.LL128),
        ("mi300x", 2, 5 * MIB, Protocol.SIMPLE),
        ("mi325x", 2, 4 * MIB, Protocol.LL128),
        ("mi355x", 2, 32 * MIB, Protocol.LL128),
    ],
)
def test_across_nodes_all_reduce_runs_the_protocol_of_rccls_size_ranges(profile, nodes, nbytes, protocol):
    # rcclUpdateCollectiveProtocol: across nodes the protocol is the one whose range holds the bytes per
    # rank, whatever the cost says (the 32 MiB row of ROCm/rocm-systems#9406 ran ring/LL128)
    assert estimate("all_reduce", nbytes, 8 * nodes, load_profile(profile), 8).protocol is protocol


def test_across_nodes_the_other_collectives_divide_by_the_ranks():
    # all_gather, reduce_scatter, broadcast, reduce: RCCL compares the buffer over the ranks
    mi350 = load_profile("mi350x")
    assert estimate("all_gather", 16 * 8 * MIB, 16, mi350, 8).protocol is Protocol.LL128  # 8 MiB a rank
    assert estimate("all_gather", 16 * 9 * MIB, 16, mi350, 8).protocol is Protocol.SIMPLE
    assert estimate("reduce_scatter", 16 * 64 * 2**10, 16, mi350, 8).protocol is Protocol.LL
    assert estimate("broadcast", 16 * 2048, 16, mi350, 8).protocol is Protocol.LL
    assert estimate("broadcast", 16 * 16 * MIB, 16, mi350, 8).protocol is Protocol.LL128
    assert estimate("reduce", 16 * 17 * MIB, 16, mi350, 8).protocol is Protocol.SIMPLE
    # all_to_all and send/recv keep RCCL's p2p threshold
    assert estimate("all_to_all", 32 * MIB, 16, mi350, 8).protocol is Protocol.SIMPLE


def test_ll128_on_gfx942_and_gfx950_is_priced_as_ll():
    # RCCL's tuning_model_5 and tuning_model_6 give LL128 LL's hwLat and bwRatio; the model does the same
    mi350 = load_profile("mi350x")
    est = estimate("all_reduce", 32 * MIB, 16, mi350, 8)
    nic = mi350.nic_gbps / 8 * NIC_EFFICIENCY
    xgmi = 7 * mi350.xgmi_gbps_per_link * XGMI_EFFICIENCY
    assert (est.algorithm, est.protocol) == (Algorithm.RING, Protocol.LL128)
    assert est.bus_gbps == pytest.approx(min(8 * nic, xgmi * 8 / 7) * PROTOCOL_BW_FRACTION[Protocol.LL])


def test_estimate_fields_and_edges():
    est = estimate("all_gather", 64 * MIB, 8, load_profile("mi350x"))
    assert est.op is Collective.ALL_GATHER and est.ranks == 8 and est.nodes == 1
    assert est.busbw_gbps == pytest.approx(est.algbw_gbps * 7 / 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.seconds = 0.0  # type: ignore[misc]
    assert estimate("all_reduce", MIB, 1, MI300X).seconds == 0.0
    with pytest.raises(ValueError):
        estimate("gather", MIB, 8, MI300X)
    with pytest.raises(ValueError):
        estimate("all_reduce", -1, 8, MI300X)


def test_faster_links_make_faster_collectives():
    mi300, mi350 = (estimate("all_reduce", GIB, 8, load_profile(p)) for p in ("mi300x", "mi350x"))
    assert mi350.seconds < mi300.seconds


def test_rings_across_nodes_use_every_rail_of_the_node():
    # 2 x 8 MI300X: 8 NICs of ~46 GB/s carry the rings together (368 GB/s), and xGMI, carrying
    # 7/8 of each GPU's ring traffic, allows 8/7 of one GPU's 7 links (363 GB/s): xGMI binds.
    est = estimate("all_reduce", 16 * GIB, 16, MI300X, ranks_per_node=8)
    nic = MI300X.nic_gbps / 8 * NIC_EFFICIENCY
    xgmi = 7 * MI300X.xgmi_gbps_per_link * XGMI_EFFICIENCY
    assert est.bus_gbps == pytest.approx(min(MI300X.nics_per_node * nic, xgmi * 8 / 7))
    # one GPU per node has one rail: the NIC is the bus
    assert estimate("all_reduce", 16 * GIB, 2, MI300X, ranks_per_node=1).bus_gbps == pytest.approx(nic)
    # fewer NICs than GPUs: the NICs bind
    two_nics = dataclasses.replace(MI300X, nics_per_node=2)
    assert estimate("all_reduce", 16 * GIB, 16, two_nics, 8).bus_gbps == pytest.approx(2 * nic)


def test_all_to_all_across_nodes_runs_at_one_nic():
    est = estimate("all_to_all", 16 * GIB, 16, MI300X, ranks_per_node=8)
    assert est.bus_gbps == pytest.approx(MI300X.nic_gbps / 8 * NIC_EFFICIENCY)


def test_published_tables_are_split_before_fitting():
    bench = _bench()
    fit, held = bench.published("fit"), bench.published("heldout")
    assert fit and held
    assert {r.table for r in fit}.isdisjoint({r.table for r in held})
    assert all(r.table.startswith("heldout_") for r in held)


def test_held_out_two_node_all_reduce_runs_rccls_protocol_and_simple_stays_within_the_goal():
    # MI350X, 2 x 8, RCCL's current defaults (ROCm/rocm-systems#9406): never fitted to. The model runs
    # RCCL's protocol at every size (LL128 at 32 MiB, Simple at 64 and 128 MiB; a ring where RCCL ran a
    # tree at 64 MiB). The Simple rows are within issue #30's 15 % (-0.2 %, +0.5 %). LL128, priced as LL
    # as RCCL's gfx950 tables price it, is -23.6 % at 32 MiB (docs/clocked.md); past 24 % fails.
    rows = [r for r in _bench().published("heldout") if r.reported.endswith("(after)")]
    assert len(rows) == 3
    for r in rows:
        rccl_protocol = r.reported.split()[0].split("/")[1]
        assert rccl_protocol == r.model_choice.split("/")[1], (r.nbytes, r.reported, r.model_choice)
        bound = 0.24 if rccl_protocol == "LL128" else 0.15
        assert abs(r.error) <= bound, (r.nbytes, r.error)


def test_held_out_single_node_figures_of_every_collective_are_within_the_goal():
    # AMD's CVS bars for one node of 8 (MI300X, MI350X all_reduce; MI355X all_reduce, all_gather,
    # reduce_scatter, all_to_all, broadcast at 8 and 16 GiB), never fitted to: worst +12.2 %
    # (MI355X all_to_all at 8 GiB), within issue #30's 15 % (docs/clocked.md).
    rows = [r for r in _bench().published("heldout") if r.table == "heldout_cvs_1node_expected"]
    assert {r.profile for r in rows} == {"mi300x", "mi350x", "mi355x"} and len(rows) == 12
    for r in rows:
        assert abs(r.error) <= 0.15, (r.collective, r.profile, r.nbytes, r.error)


def test_a_ring_all_reduce_across_nodes_pays_nccls_plateau_latency():
    # NCCL's ncclTopoGetAlgoTime: ring/Simple all-reduce across nodes, 1.4 x the latency past 64 B per
    # channel and rank; inside a node, other protocols and other collectives do not pay it.
    # a target without RCCL's size ranges, so that Simple is priced at every size
    mi350 = dataclasses.replace(load_profile("mi350x"), gfx="gfx90a")
    ring = {(e.algorithm, e.protocol): e for e in candidates("all_reduce", 64 * MIB, 16, mi350, 8)}
    one_node, one_node_small = ({(e.algorithm, e.protocol): e for e in candidates("all_reduce", n, 8, mi350)}
                                for n in (64 * MIB, 4096))
    small = {(e.algorithm, e.protocol): e for e in candidates("all_reduce", 4096, 16, mi350, 8)}
    simple = (Algorithm.RING, Protocol.SIMPLE)
    assert ring[simple].latency_s == pytest.approx(small[simple].latency_s * RING_PLATEAU_LATENCY_FACTOR)
    assert one_node[simple].latency_s == pytest.approx(one_node_small[simple].latency_s)
    gather = {(e.algorithm, e.protocol): e for e in candidates("all_gather", 64 * MIB, 16, mi350, 8)}
    small_gather = {(e.algorithm, e.protocol): e for e in candidates("all_gather", 4096, 16, mi350, 8)}
    assert gather[simple].latency_s == pytest.approx(small_gather[simple].latency_s)


def test_fit_set_two_node_figures_within_their_recorded_error():
    # AMD CVS two-node figures (8 and 16 GiB): all within 10 % but broadcast, +16.6 %.
    for r in _bench().published("fit"):
        bound = 0.17 if r.collective == "broadcast" else 0.10
        assert abs(r.error) <= bound, (r.table, r.collective, r.nbytes, r.error)


def test_bench_reproduces_published_rccl_tests_within_15_percent():
    bench = _bench()
    rows = bench.compare("mi300x")
    assert {r.nbytes for r in rows if r.published} == set(bench.PUBLISHED_BUSBW)
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= bench.TOLERANCE, bench.format_table(rows)
