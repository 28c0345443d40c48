"""A rank that leaves children behind and exits 0: one in its process group, one that escaped it (setsid).

Prints ``child pid=...`` for each; neither may outlive the session.
"""

import os
import subprocess
import sys
import time

sleeper = subprocess.Popen(["sleep", "600"])
print(f"child pid={sleeper.pid} (same process group)", flush=True)
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # double fork + setsid: a daemonised grandchild in a session of its own
    os.setsid()
    if os.fork() == 0:
        os.write(w, f"{os.getpid()}\n".encode())
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0)
escaped = int(os.read(r, 64).decode().strip())
print(f"child pid={escaped} (own session)", flush=True)
print("parent exiting", file=sys.stderr, flush=True)
