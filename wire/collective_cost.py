"""An RCCL-like cost model for collectives: how long one takes on the profile's hardware.

The shape follows RCCL's tuner (ROCm/rccl ``src/graph/tuning.cc``, read at commit
0cbce2a, and its port in torch's ``torch/_inductor/comm_analysis.py``): every
(algorithm, protocol) pair gets a latency and a bus bandwidth, its time is
``latency + bytes * bus_factor / bus_bandwidth``, and the fastest pair is the one
RCCL would pick. Where RCCL's tuning constants are selection heuristics that miss
measured times (its 12 µs LL base latency puts an 8-GPU all-reduce at 23 µs; rccl-tests
measures 13 µs), the constants here are calibrated to published rccl-tests figures
instead; each says where it comes from. Across nodes on gfx942 and gfx950 RCCL does not pick the
protocol by cost but by size ranges (``NET_PROTOCOL_RANGES``); the model does the same.
``docs/clocked.md`` has the formulas and the validation table (``bench/clocked_collectives.py``).

Sizes follow rccl-tests' ``size`` column: the per-rank buffer for all_reduce, broadcast,
reduce, all_to_all and send/recv; the whole gathered buffer (``count * ranks``) for
all_gather and reduce_scatter. This module is numpy/stdlib only: the daemon imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from wire.profiles import Profile


class Collective(Enum):
    """The collectives the model prices, named as c10d names them."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


class Algorithm(Enum):
    """RCCL's algorithms that this model knows (no CollNet, NVLS or MSCCL)."""

    RING = "ring"
    TREE = "tree"


class Protocol(Enum):
    """RCCL's wire protocols: LL (8-byte flagged lines), LL128, Simple (bulk with fences)."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


# --- Bandwidth -------------------------------------------------------------------------------

#: Fraction of the xGMI line rate (links x GB/s per link) a large Ring/Simple collective
#: achieves. 319 GB/s busbw at 16 GB on 8 x MI300X (rccl-tests, ../shared/REFERENCE.md)
#: over 7 x 64 GB/s = 0.712; the ROCm blog "Understanding RCCL Bandwidth and xGMI
#: Performance on MI300X" measures ~48 of 64 GB/s (0.75) per link for plain copies.
XGMI_EFFICIENCY = 0.71

#: Fraction of the NIC line rate a ring achieves across nodes: meta-pytorch/autoparallel's
#: fitted H100 + RoCE 400G tables (cost_models/h100_nvswitch_roce_400g.py) put all_gather at
#: 1 GPU per node, 8-32 nodes, at 46-48 GB/s of 50. AMD's two-node CVS figures for send/recv
#: (47-48 GB/s over one 400 Gb/s NIC, bench/data/rccl_tests/fit_cvs_2node_expected.csv) agree.
NIC_EFFICIENCY = 0.92

#: Bus bandwidth of each protocol relative to Simple. LL carries 4 data bytes per 8-byte line,
#: so at most 0.5; 0.37 is fitted to the 1 MB rccl-tests point (66.9 GB/s busbw, LL's regime).
#: LL128 carries 120 of every 128 bytes (NVIDIA/nccl tuning.cc, 120.0/128.0).
PROTOCOL_BW_FRACTION = {Protocol.LL: 0.37, Protocol.LL128: 120.0 / 128.0, Protocol.SIMPLE: 1.0}

#: Tree bus bandwidth relative to ring, same protocol, from the table RCCL picks for 8-GPU nodes
#: fully connected by 7 xGMI links (rome_models.cc tuning=5, the MI300X layout)
#: (tuning.cc tuning_model_5, bwRatio: Tree {LL 0.06, Simple 0.11 (<=2 nodes) / 0.59 (>2 nodes)}
#: over Ring {LL 0.08, Simple 1.00}); LL128 from tuning_model_4 (Tree 1.09 over Ring 0.41,
#: capped at 1).
TREE_BW_RATIO = {
    Protocol.LL: (0.06 / 0.08, 0.06 / 0.08),
    Protocol.LL128: (1.0, 1.0),
    Protocol.SIMPLE: (0.11, 0.59),
}

# --- Latency ---------------------------------------------------------------------------------

#: Fixed latency per protocol (µs), once per collective. Simple: RCCL's baseLat (tuning.cc,
#: 17.0). LL and LL128: calibrated so that an 8-rank all-reduce (14 ring steps of 0.8 µs) costs
#: the 13 µs rccl-tests measures for 1-64 KB on 8 x MI300X (13 - 14 x 0.8 = 1.8).
BASE_LATENCY_US = {Protocol.LL: 1.8, Protocol.LL128: 1.8, Protocol.SIMPLE: 17.0}

#: Latency of one step over xGMI (µs), per algorithm and protocol: RCCL's 8-GPU xGMI table
#: (tuning.cc tuning_model_5, hwLat[NVLINK]: Tree {LL 0.9, Simple 2.3}, Ring {LL 0.8,
#: Simple 2.1}); LL128 from tuning_model_4 (Tree 1.4, Ring 2.2), the only table with LL128.
XGMI_HOP_US = {
    (Algorithm.TREE, Protocol.LL): 0.9,
    (Algorithm.TREE, Protocol.LL128): 1.4,
    (Algorithm.TREE, Protocol.SIMPLE): 2.3,
    (Algorithm.RING, Protocol.LL): 0.8,
    (Algorithm.RING, Protocol.LL128): 2.2,
    (Algorithm.RING, Protocol.SIMPLE): 2.1,
}

#: An inter-node step costs the profile's ``nic_latency_us`` (a ring LL step) times this factor,
#: per algorithm: NVIDIA/nccl tuning.cc hwLat[NET] = Ring {LL 2.7, LL128 4.0, Simple 14.0},
#: Tree {LL 5.0, LL128 8.5, Simple 14.0} µs (the same table in RCCL's ncclTunerConstantsDefaults).
#: A tree step waits for its children before it forwards, so it costs more than a ring's.
NET_PROTOCOL_LATENCY_FACTOR = {
    (Algorithm.RING, Protocol.LL): 1.0,
    (Algorithm.RING, Protocol.LL128): 4.0 / 2.7,
    (Algorithm.RING, Protocol.SIMPLE): 14.0 / 2.7,
    (Algorithm.TREE, Protocol.LL): 5.0 / 2.7,
    (Algorithm.TREE, Protocol.LL128): 8.5 / 2.7,
    (Algorithm.TREE, Protocol.SIMPLE): 14.0 / 2.7,
}

#: Host proxy overhead per step once a ring leaves the node (µs); Simple pays it 3 times.
#: RCCL tuning.cc getNetOverhead(): 2.0 on AMD x86 hosts.
NET_OVERHEAD_US = 2.0

#: A ring/Simple all-reduce across nodes pays its latency this many times once every channel carries
#: at least ``RING_PLATEAU_MIN_BYTES`` per rank: NCCL's "plateau effect of ring" (NVIDIA/nccl
#: src/graph/tuning.cc, ncclTopoGetAlgoTime, ``lat *= minCompCap < 80 ? 1.9 : 1.4``, read at 5067397).
#: The inter-node step costs above are NCCL's, measured together with this term; without it the model
#: was 16 % fast at 64 MiB on held-out 2 x 8 MI350X figures (docs/clocked.md).
RING_PLATEAU_LATENCY_FACTOR = 1.4
RING_PLATEAU_MIN_BYTES = 64

#: Channels RCCL runs a collective across nodes with on gfx942/gfx950 at the sizes where the plateau
#: applies: 64 (ROCm/rocm-systems#7848; #9406 reports 64 at 32 and 64 MiB, 48 at 128 MiB).
MULTI_NODE_CHANNELS = 64

#: Send/recv use LL up to this many bytes, Simple above: RCCL enqueue.cc, NCCL_P2P_LL_THRESHOLD.
P2P_LL_THRESHOLD = 16384

#: GPU targets where the model offers LL128 by cost inside a node: gfx90a, where RCCL's Rome models for
#: MI250 set ``ll128Enabled=1`` (ROCm/rccl src/graph/rome_models.cc, ``tuning=4,ll128Enabled=1``). On gfx942
#: and gfx950 RCCL never runs LL128 inside one node by default: the only 8-GPU, 7-link model without NICs
#: (rome_model_79, ``noCpuCheck=1,tuning=5,disableNumaMatching=1``) leaves ``ll128Enabled`` off, and one
#: node's NICs are trimmed before a model is matched. Across nodes see ``NET_PROTOCOL_RANGES``.
LL128_GFX = frozenset({"gfx90a"})


@dataclass(frozen=True)
class ProtocolRanges:
    """RCCL's size ranges for one collective across nodes (``llProtoRanges``): per-rank bytes."""

    ll_max: int  # LL on (0, ll_max]
    ll128_min: int  # LL128 on (ll128_min, ll128_max], where the platform enables it; it overrides LL
    ll128_max: int


#: Across nodes RCCL does not pick the protocol by cost on gfx942 and gfx950: after its tuner picks the
#: algorithm, ``rcclUpdateCollectiveProtocol`` (ROCm/rocm-systems projects/rccl/src/rccl_wrap.cc at
#: 006a440, called from ``topoGetAlgoInfo`` in src/enqueue.cc at 005e1bb) sets it by the bytes per rank
#: alone: Simple, LL on (0, ll_max], LL128 on (ll128_min, ll128_max] when ``comm->topo->ll128Enabled``.
#: The ranges are the ``llProtoRanges`` of the tuning model RCCL picks by arch (src/graph/tuning.cc at
#: 03a8914, ``rcclGetTuningIndexForArch``: gfx942 -> tuning_model_5, gfx950 -> tuning_model_6). Bytes per
#: rank (``rcclGetSizePerRank``, src/include/rccl_common.h at 00b959f) are the buffer for all_reduce and
#: the buffer over the ranks for all_gather, reduce_scatter, broadcast and reduce. gfx950 all_reduce: the
#: stored tuning.cc says LL128 up to 70640910 B, which is RCCL before ROCm/rocm-systems#9406 (LL128 at 32
#: and 64 MiB in its "before" table); the fix's own table shows RCCL on LL128 at 32 MiB and on Simple at
#: 64 MiB, so the fix lowered the bound into [32, 64) MiB. Its new constant is in no stored copy; the
#: model uses 32 MiB, the largest size #9406 shows on LL128 (a bound set after reading that held-out
#: file's protocol column, not its figures: docs/clocked.md).
NET_PROTOCOL_RANGES: dict[str, dict[Collective, ProtocolRanges]] = {
    "gfx942": {
        Collective.REDUCE_SCATTER: ProtocolRanges(655360, 131072, 3211264),
        Collective.ALL_GATHER: ProtocolRanges(98304, 98304, 5046272),
        Collective.ALL_REDUCE: ProtocolRanges(524288, 524288, 4415057),
        Collective.REDUCE: ProtocolRanges(4096, 4096, 16777216),
        Collective.BROADCAST: ProtocolRanges(8192, 8192, 33554432),
    },
    "gfx950": {
        Collective.REDUCE_SCATTER: ProtocolRanges(65536, 65536, 8388608),
        Collective.ALL_GATHER: ProtocolRanges(65536, 65536, 8388608),
        Collective.ALL_REDUCE: ProtocolRanges(262144, 262144, 32 * 2**20),
        Collective.REDUCE: ProtocolRanges(16383, 16383, 16777216),
        Collective.BROADCAST: ProtocolRanges(2048, 2048, 16777216),
    },
}

#: An all_reduce across more than two nodes keeps LL128 up to this many times ``ll128_max``
#: (rccl_wrap.cc: ``if(comm->nNodes > 2) ll128Max *= 3.8``).
LL128_MAX_SCALE_PAST_TWO_NODES = 3.8

#: RCCL turns ``ll128Enabled`` on for gfx942 and gfx950 nodes through the Rome model its topology matches
#: (src/graph/rome_models.cc at 0eb07b2, by structure, not bus ids): the 8-GPU, 7-link, 8-NIC layouts
#: (one NIC per GPU or per pair of GPUs on their PCIe switch, rome_model_81 and rome_model_89:
#: ``noCpuCheck=1,tuning=5,ll128Enabled=1,disableNumaMatching=1``; on gfx950 ``rcclApplyTuningOverrides``
#: then sets tuning 6). The 4-NIC layouts differ (rome_model_87 has it,
#: rome_model_88 not), the 16-NIC one (rome_model_84) has not; ``RCCL_LL128_FORCE_ENABLE=1`` turns it on
#: anywhere (init.cc). The model takes the bundled profiles' layout, 8 GPUs a node with one NIC each.
LL128_NET_NICS_PER_NODE = frozenset({8})
LL128_NET_GPUS_PER_NODE = 8

#: How the model prices LL128 where RCCL's tables give it no figure of its own: RCCL's gfx942 and gfx950
#: tuning models (tuning_model_5, tuning_model_6) give LL128 the same per-hop latencies (hwLat) and
#: bandwidth ratios (bwRatio) as LL, so the model prices LL128 there as LL. No published AMD figure of
#: LL128 is outside the held-out set; NCCL's 120/128 of Simple's bandwidth would be 73 % fast on #9406's
#: 32 MiB row, LL's pricing is 24 % slow (docs/clocked.md).
LL128_PRICED_AS_LL_GFX = frozenset({"gfx942", "gfx950"})


@dataclass(frozen=True)
class CollectiveEstimate:
    """The modeled cost of one collective, with the choice that produced it."""

    op: Collective
    nbytes: int
    ranks: int
    nodes: int
    algorithm: Algorithm
    protocol: Protocol
    seconds: float  # latency + bandwidth term
    latency_s: float  # the size-independent part
    bus_gbps: float  # bus bandwidth of the bandwidth term, rccl-tests convention (GB/s, 1e9)

    @property
    def algbw_gbps(self) -> float:
        """What rccl-tests prints as algbw: size over time, GB/s (infinite for a free collective)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds else math.inf

    @property
    def busbw_gbps(self) -> float:
        """What rccl-tests prints as busbw: algbw times the collective's bus factor."""
        return self.algbw_gbps * bus_factor(self.op, self.ranks)


def bus_factor(op: Collective, ranks: int) -> float:
    """rccl-tests' busbw / algbw ratio (nccl-tests doc/PERFORMANCE.md): bytes each rank moves per byte of size."""
    n = ranks
    if op is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


def _ring_steps(op: Collective, ranks: int, nodes: int) -> tuple[int, int]:
    """(all steps, inter-node steps) of a ring, as RCCL's tuning.cc counts them."""
    if op is Collective.ALL_REDUCE:
        return 2 * (ranks - 1), (2 * nodes if nodes > 1 else 0)
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return ranks - 1, nodes - 1
    return ranks, (nodes if nodes > 1 else 0)


def _xgmi_gbps(profile: Profile, peers: int) -> float:
    """Achieved xGMI bandwidth out of one GPU to ``peers`` peers of its node: one link per peer (fully connected)."""
    return min(profile.xgmi_links, peers) * profile.xgmi_gbps_per_link * XGMI_EFFICIENCY


def _nic_gbps(profile: Profile) -> float:
    """Achieved bandwidth of one NIC, GB/s."""
    return profile.nic_gbps / 8 * NIC_EFFICIENCY


def _rail_ring_gbps(profile: Profile, ppn: int) -> float:
    """Bus bandwidth of RCCL's rings across nodes on a rail-optimised fabric (one NIC per GPU).

    RCCL builds one ring per channel and starts each at a different NIC (search.cc: NET n ->
    GPU a -> ... -> GPU x -> NET n), so its channels leave every node through all of the node's
    NICs at once: the node's NICs together carry the bus bandwidth. Inside the node each GPU sends
    (ppn-1)/ppn of its ring traffic over xGMI and the rest through its own NIC, so xGMI bounds
    the bus bandwidth at ppn/(ppn-1) times what one GPU's links carry. The slower bound wins.
    """
    rails = min(profile.nics_per_node, ppn) * _nic_gbps(profile)
    if ppn == 1:
        return rails
    return min(rails, _xgmi_gbps(profile, ppn - 1) * ppn / (ppn - 1))


def _net_protocol(op: Collective, nbytes: int, ranks: int, nodes: int, ppn: int, profile: Profile) -> Protocol | None:
    """The protocol RCCL's size ranges set across nodes, or None where the cost decides (see NET_PROTOCOL_RANGES)."""
    ranges = NET_PROTOCOL_RANGES.get(profile.gfx, {}).get(op)
    if nodes < 2 or ranges is None:
        return None
    per_rank = nbytes if op is Collective.ALL_REDUCE else nbytes // ranks
    proto = Protocol.LL if 0 < per_rank <= ranges.ll_max else Protocol.SIMPLE
    if ppn == LL128_NET_GPUS_PER_NODE and profile.nics_per_node in LL128_NET_NICS_PER_NODE:
        past_two = op is Collective.ALL_REDUCE and nodes > 2
        ll128_max = ranges.ll128_max * (LL128_MAX_SCALE_PAST_TWO_NODES if past_two else 1)
        if ranges.ll128_min < per_rank <= ll128_max:
            proto = Protocol.LL128
    return proto


def _protocols(op: Collective, nbytes: int, ranks: int, nodes: int, ppn: int, profile: Profile) -> list[Protocol]:
    """The protocols the model prices: RCCL's choice where its size ranges make it, else all it enables."""
    forced = _net_protocol(op, nbytes, ranks, nodes, ppn, profile)
    if forced is not None:
        return [forced]
    return [p for p in Protocol if p is not Protocol.LL128 or profile.gfx in LL128_GFX]


def _priced_as(profile: Profile, proto: Protocol) -> Protocol:
    """The protocol whose constants price ``proto`` on ``profile`` (LL128 as LL on gfx942/gfx950)."""
    return Protocol.LL if proto is Protocol.LL128 and profile.gfx in LL128_PRICED_AS_LL_GFX else proto


def _net_step_us(profile: Profile, algo: Algorithm, proto: Protocol) -> float:
    return profile.nic_latency_us * NET_PROTOCOL_LATENCY_FACTOR[(algo, proto)]


def _estimate(
    op: Collective,
    nbytes: int,
    ranks: int,
    nodes: int,
    ppn: int,
    algo: Algorithm,
    proto: Protocol,
    profile: Profile,
) -> CollectiveEstimate | None:
    """One (algorithm, protocol) pair's cost, or None where RCCL does not offer it."""
    price = _priced_as(profile, proto)
    intra = _xgmi_gbps(profile, ppn - 1) if ppn > 1 else math.inf  # one rank per node: no xGMI leg
    bus = (intra if nodes == 1 else _rail_ring_gbps(profile, ppn)) * PROTOCOL_BW_FRACTION[price]
    lat_us = BASE_LATENCY_US[price]
    hop = XGMI_HOP_US[(algo, price)]
    if algo is Algorithm.TREE:
        # RCCL skips Tree/Simple inside one gfx94 node (tuning.cc); no gfx950 table says otherwise.
        if op is not Collective.ALL_REDUCE or (nodes == 1 and proto is Protocol.SIMPLE):
            return None
        bus *= TREE_BW_RATIO[price][0 if nodes <= 2 else 1]
        lat_us += 2 * ((ppn - 1) * hop + math.ceil(math.log2(nodes)) * _net_step_us(profile, algo, price))
        # Tree all-reduce moves every byte up and down: algbw = bus / 2 (tuning.cc's 0.5 ratio);
        # expressed in rccl-tests' convention the bus bandwidth is algbw x 2(n-1)/n.
        bus = bus / 2 * bus_factor(op, ranks)
    elif op in (Collective.ALL_TO_ALL, Collective.SEND_RECV):
        # Point-to-point: every peer at once over its own link (or the NIC), one step of latency.
        if proto is not (Protocol.LL if nbytes <= P2P_LL_THRESHOLD else Protocol.SIMPLE):
            return None  # RCCL picks the p2p protocol by size alone, not by the tuner
        lat_us += hop + (_net_step_us(profile, algo, proto) if nodes > 1 else 0.0)
        if op is Collective.SEND_RECV:
            bus = (_nic_gbps(profile) if nodes > 1 else _xgmi_gbps(profile, 1)) * PROTOCOL_BW_FRACTION[proto]
        elif nodes == 1:
            bus = intra * PROTOCOL_BW_FRACTION[proto]
        else:
            # Across nodes all-to-all runs at one NIC's rate: it "cannot aggregate the bandwidth
            # of multiple NICs, so the performance you should see is the performance of a single
            # NIC" (NCCL maintainer, NVIDIA/nccl-tests#267); AMD's two-node CVS figures say the
            # same for RCCL (45-50 GB/s busbw over 400 Gb/s NICs).
            bus = _nic_gbps(profile) * PROTOCOL_BW_FRACTION[proto]
    else:
        steps, inter_steps = _ring_steps(op, ranks, nodes)
        if nodes > 1:
            # A ring that leaves the node pays the host proxy on every step (tuning.cc).
            hop = max(hop, NET_OVERHEAD_US * (3 if proto is Protocol.SIMPLE else 1))
        lat_us += (steps - inter_steps) * hop + inter_steps * _net_step_us(profile, algo, price)
        if (
            nodes > 1
            and op is Collective.ALL_REDUCE
            and proto is Protocol.SIMPLE
            and nbytes // (MULTI_NODE_CHANNELS * ranks) >= RING_PLATEAU_MIN_BYTES
        ):
            lat_us *= RING_PLATEAU_LATENCY_FACTOR
    latency_s = lat_us * 1e-6
    seconds = latency_s + nbytes * bus_factor(op, ranks) / (bus * 1e9)
    return CollectiveEstimate(op, nbytes, ranks, nodes, algo, proto, seconds, latency_s, bus)


def candidates(
    op: Collective | str, nbytes: int, ranks: int, profile: Profile, ranks_per_node: int | None = None
) -> list[CollectiveEstimate]:
    """Every (algorithm, protocol) pair RCCL would consider for this collective, each with its cost.

    Across nodes on gfx942 and gfx950 RCCL's size ranges fix the protocol (``NET_PROTOCOL_RANGES``): then
    only that protocol's pairs are listed, one per algorithm.
    """
    op = Collective(op)
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"need ranks >= 1 and nbytes >= 0, got ranks={ranks} nbytes={nbytes}")
    ppn = min(ranks, ranks_per_node or ranks)
    nodes = math.ceil(ranks / ppn)
    out = []
    for algo in Algorithm:
        for proto in _protocols(op, nbytes, ranks, nodes, ppn, profile):
            est = _estimate(op, nbytes, ranks, nodes, ppn, algo, proto, profile)
            if est is not None:
                out.append(est)
    return out


def estimate(
    op: Collective | str, nbytes: int, ranks: int, profile: Profile, ranks_per_node: int | None = None
) -> CollectiveEstimate:
    """The modeled cost of collective ``op`` of ``nbytes`` (rccl-tests' size) over ``ranks`` GPUs.

    ``ranks_per_node`` (default: all on one node) splits the ranks into emulated nodes
    joined by the profile's NIC. The algorithm and protocol are the fastest of
    :func:`candidates`, as RCCL's tuner picks them; across nodes on gfx942 and gfx950 the protocol is
    the one RCCL's size ranges set, and the algorithm the fastest with it. A single rank costs nothing.
    """
    op = Collective(op)
    if ranks == 1:
        return CollectiveEstimate(op, nbytes, 1, 1, Algorithm.RING, Protocol.SIMPLE, 0.0, 0.0, math.inf)
    return min(candidates(op, nbytes, ranks, profile, ranks_per_node), key=lambda e: e.seconds)
