"""A rank that closes its stdout (the descriptor itself) and carries on writing to stderr."""

import os
import sys

print("before closing stdout", flush=True)
os.close(1)
try:
    print("this line has nowhere to go", flush=True)
except OSError as e:
    print(f"stdout is closed (errno {e.errno})", file=sys.stderr, flush=True)
for i in range(3):
    print(f"still running {i}", file=sys.stderr, flush=True)
sys.stdout = None  # so that interpreter shutdown does not flush into the closed descriptor
