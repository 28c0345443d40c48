"""The daemon's detectors on a ledger driven by hand (no processes): hang and straggler."""

from __future__ import annotations

from emulator.hang import HangDetector
from emulator.ledger import Ledger, Worlds
from emulator.straggler import StragglerDetector
from wire.schema import Collective, CollOp, CommInit, WorldFormation


def ledger_of(size: int, globals_: list[int] | None = None) -> Ledger:
    ledger = Ledger()
    for r in range(size):
        g = globals_[r] if globals_ else r
        ledger.join(CommInit(comm="c", rank=r, size=size, global_rank=g, host="h"))
    return ledger


def post(ledger: Ledger, rank: int, seq: int, at: float, site: str = ""):
    comm, matched = ledger.post(b"x", Collective(comm="c", seq=seq, rank=rank, device=rank, numel=4, site=site))
    slot = matched or list(comm.posted[seq].values())
    for p in slot:
        if p.request.rank == rank:
            p.at = at
    return comm, matched


def test_hang_found_once_after_the_timeout_with_global_ranks():
    ledger = ledger_of(3, globals_=[4, 5, 6])
    for seq in (1, 2):
        for r in range(3):
            post(ledger, r, seq, at=0.0)
        ledger.complete(ledger.comms["c"], seq)
    post(ledger, 0, 3, at=10.0, site="train.py:9:step")
    post(ledger, 2, 3, at=11.0)
    det = HangDetector(timeout_s=5.0)
    assert det.scan(ledger, now=14.9) == []
    (h,) = det.scan(ledger, now=15.0)
    assert (h.seq, h.op, h.joined, h.missing) == (3, CollOp.ALLREDUCE, [4, 6], [5])
    assert h.sites[0] == "train.py:9:step"
    assert h.last_enqueued == [2] and h.last_completed == [2]
    assert det.scan(ledger, now=100.0) == []  # reported once


def test_straggler_needs_a_streak_of_late_arrivals_by_the_same_rank():
    ledger = ledger_of(3)
    det = StragglerDetector(margin_s=0.25, streak=3)
    warnings = []
    for seq in range(1, 6):
        late = 1 if seq != 2 else 2  # rank 2 is late once, breaking rank 1's first streak
        matched = None
        for r in range(3):
            comm, matched = post(ledger, r, seq, at=seq * 10 + (0.5 if r == late else 0.0))
        warnings.append(det.observe(comm, matched))
    found = [w for w in warnings if w is not None]
    assert len(found) == 1 and found[0].rank == 1 and found[0].count == 3
    assert abs(found[0].mean_margin_s - 0.5) < 1e-6


def test_small_margins_are_not_stragglers():
    ledger = ledger_of(2)
    det = StragglerDetector(margin_s=0.25, streak=2)
    for seq in range(1, 6):
        for r in range(2):
            comm, matched = post(ledger, r, seq, at=seq + (0.1 if r else 0.0))
        assert det.observe(comm, matched) is None


def test_a_rank_busy_in_a_running_collective_is_not_hung():
    ledger = ledger_of(2)
    post(ledger, 0, 1, at=0.0)
    det = HangDetector(timeout_s=1.0)
    assert det.scan(ledger, now=50.0, busy=frozenset({1})) == []  # rank 1 is inside a long collective elsewhere
    (h,) = det.scan(ledger, now=60.0)  # once it is not, and still missing, it is reported
    assert h.missing == [1]


def test_a_rank_stopped_in_its_debugger_is_not_hung_and_its_wait_counts_from_when_it_runs_again():
    ledger = ledger_of(2)
    post(ledger, 0, 1, at=0.0)
    det = HangDetector(timeout_s=1.0)
    det.debugger(1, stopped=True)
    assert det.scan(ledger, now=100.0) == []  # --debug-rank: rank 1 sits at pdb's prompt
    det.debugger(1, stopped=False, now=100.0)  # 'c'
    assert det.scan(ledger, now=100.9) == []  # it gets the timeout to arrive, as if the wait began now
    (h,) = det.scan(ledger, now=101.0)
    assert h.missing == [1] and h.waited_s == 1.0


def test_a_rank_compiling_is_not_hung_and_its_wait_counts_from_when_it_finished():
    ledger = ledger_of(2)
    post(ledger, 0, 1, at=0.0)
    det = HangDetector(timeout_s=1.0)
    det.pause(1, "compiling", True)
    det.debugger(1, stopped=True)  # two reasons at once: both must end
    det.pause(1, "compiling", False, now=50.0)
    assert det.scan(ledger, now=100.0) == []
    det.debugger(1, stopped=False, now=100.0)
    assert det.scan(ledger, now=100.9) == []
    (h,) = det.scan(ledger, now=101.0)
    assert h.missing == [1]


def test_a_world_waiting_for_a_rank_in_its_debugger_is_not_hung():
    worlds, det = Worlds(), HangDetector(timeout_s=1.0)
    worlds.record(WorldFormation(world="env://h:1 #1", rank=0, size=2, pid=10), alive=lambda p, h: True)
    det.debugger(1, stopped=True)  # stopped before its program ran: it never reached init_process_group
    assert det.scan_worlds(worlds, alive=lambda p, h: True, now=1e9) == []
    det.debugger(1, stopped=False, now=1e9)
    (h,) = det.scan_worlds(worlds, alive=lambda p, h: True, now=1e9 + 1)
    assert h.missing == [1]
