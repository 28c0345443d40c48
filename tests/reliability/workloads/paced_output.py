"""A rank that prints 1 KiB lines at about 2 MiB/s for ``SECONDS_`` seconds (a disk filling up steadily).

With ``SURVIVE_WRITE_ERRORS=1`` a write that fails (the disk is full) is dropped and the rank goes on,
so that only the session's own failure can end the run.
"""

import os
import time

line = "y" * 1014
end = time.monotonic() + float(os.environ.get("SECONDS_", "30"))
survive = os.environ.get("SURVIVE_WRITE_ERRORS") == "1"
n = 0
while time.monotonic() < end:
    chunk = "".join(f"{n + i:08d} {line}\n" for i in range(20)).encode()
    n += 20
    try:
        os.write(1, chunk)
    except OSError:
        if not survive:
            raise
    time.sleep(0.01)
