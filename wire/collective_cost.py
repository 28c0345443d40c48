"""An RCCL-like cost model for collectives: how long one takes on the profile's hardware.

The shape follows RCCL's tuner (ROCm/rccl ``src/graph/tuning.cc``, read at commit
0cbce2a, and its port in torch's ``torch/_inductor/comm_analysis.py``): every
(algorithm, protocol) pair gets a latency and a bus bandwidth, its time is
``latency + bytes * bus_factor / bus_bandwidth``, and the fastest pair is the one
RCCL would pick. Where RCCL's tuning constants are selection heuristics that miss
measured times (its 12 µs LL base latency puts an 8-GPU all-reduce at 23 µs; rccl-tests
measures 13 µs), the constants here are calibrated to published rccl-tests figures
instead; each says where it comes from. ``docs/clocked.md`` has the formulas and the
validation table (``bench/clocked_collectives.py``).

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

#: GPU targets where RCCL enables LL128 by default (tuning.cc: gfx90a with a tuning table only).
LL128_GFX = frozenset({"gfx90a"})


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


def _protocols(profile: Profile) -> list[Protocol]:
    return [p for p in Protocol if p is not Protocol.LL128 or profile.gfx in LL128_GFX]


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
    intra = _xgmi_gbps(profile, ppn - 1) if ppn > 1 else math.inf  # one rank per node: no xGMI leg
    bus = (intra if nodes == 1 else _rail_ring_gbps(profile, ppn)) * PROTOCOL_BW_FRACTION[proto]
    lat_us = BASE_LATENCY_US[proto]
    hop = XGMI_HOP_US[(algo, proto)]
    if algo is Algorithm.TREE:
        # RCCL skips Tree/Simple inside one gfx94 node (tuning.cc); no gfx950 table says otherwise.
        if op is not Collective.ALL_REDUCE or (nodes == 1 and proto is Protocol.SIMPLE):
            return None
        bus *= TREE_BW_RATIO[proto][0 if nodes <= 2 else 1]
        lat_us += 2 * ((ppn - 1) * hop + math.ceil(math.log2(nodes)) * _net_step_us(profile, algo, proto))
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
        lat_us += (steps - inter_steps) * hop + inter_steps * _net_step_us(profile, algo, proto)
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
    """Every (algorithm, protocol) pair RCCL would consider for this collective, each with its cost."""
    op = Collective(op)
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"need ranks >= 1 and nbytes >= 0, got ranks={ranks} nbytes={nbytes}")
    ppn = min(ranks, ranks_per_node or ranks)
    nodes = math.ceil(ranks / ppn)
    out = []
    for algo in Algorithm:
        for proto in _protocols(profile):
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
    :func:`candidates`, as RCCL's tuner picks them. A single rank costs nothing.
    """
    op = Collective(op)
    if ranks == 1:
        return CollectiveEstimate(op, nbytes, 1, 1, Algorithm.RING, Protocol.SIMPLE, 0.0, 0.0, math.inf)
    return min(candidates(op, nbytes, ranks, profile, ranks_per_node), key=lambda e: e.seconds)
