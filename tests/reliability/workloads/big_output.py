"""A rank that floods its output: ``OUT_MB`` MiB of 100-byte lines, then a ``LINE_MB`` MiB line with no newline.

No torch. Ends with a short marker line so the test knows the flood was read to the end.
"""

import os
import sys

out_mb = float(os.environ.get("OUT_MB", "0"))
line_mb = float(os.environ.get("LINE_MB", "0"))
line = b"x" * 99 + b"\n"
block = line * 10_000  # ~1 MB per write
left = int(out_mb * (1 << 20))
n_lines = 0
while left > 0:
    chunk = block[: min(left // 100, 10_000) * 100]
    if not chunk:
        break
    sys.stdout.buffer.write(chunk)
    n_lines += len(chunk) // 100
    left -= len(chunk)
if line_mb:
    sys.stdout.buffer.write(b"L" * int(line_mb * (1 << 20)))  # no newline: the next write ends it
sys.stdout.buffer.write(b"\n")
sys.stdout.buffer.flush()
print(f"flood done: {n_lines} lines", file=sys.stderr, flush=True)
