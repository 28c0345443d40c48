"""The long protocol fuzz: many seeds x many messages against fresh daemons.

    python bench/fuzz_daemon.py --seeds 20 --messages 100000

The same generator and checks as tests/reliability/test_protocol_fuzz.py (which
runs 10,000 messages of one seed in the suite): every malformed message gets
exactly one ``protocol`` error and one ``protocol_error`` event, hostile but
well-formed traffic never raises inside the daemon, and afterwards the daemon
answers a ping and computes a correct all-reduce and all-gather.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "reliability")]

from daemon_client import DaemonProcess  # noqa: E402
from test_protocol_fuzz import assert_healthy, fuzz  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=100)
    p.add_argument("--messages", type=int, default=100_000)
    a = p.parse_args()
    total = 0
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        d = DaemonProcess(hang_timeout_s=0.2)
        try:
            start = time.monotonic()
            counts = fuzz(d, seed, a.messages)
            took = time.monotonic() - start
            rss = psutil.Process(d.proc.pid).memory_info().rss >> 20
            assert_healthy(d)
        finally:
            d.stop()
        total += a.messages
        print(f"seed {seed}: {counts['refusable']} refused (each answered and logged), {counts['hostile']} hostile "
              f"well-formed, {a.messages / took:.0f} messages/s, daemon RSS {rss} MiB after; healthy", flush=True)
    print(f"{total} messages over {a.seeds} seeds: no crash, no internal error, every daemon healthy after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
