"""``python -m mirage_tui.debug_client HOST:PORT``: a terminal for a rank's remote pdb (``--debug-rank``).

What ``nc HOST PORT`` does, for machines without netcat: lines typed go to
the rank's pdb, what pdb prints comes back, and it ends when the rank hangs
up (after ``c`` or ``q``). Ctrl-D closes the connection, which lets the rank
run on. Standard library only.
"""

from __future__ import annotations

import os
import select
import socket
import sys
from collections.abc import Sequence


def bridge(sock: socket.socket, stdin_fd: int, out: int) -> None:
    """Copy ``stdin_fd`` to ``sock`` and ``sock`` to ``out`` until the other end closes the connection."""
    sources = [sock.fileno(), stdin_fd]
    while True:
        ready, _, _ = select.select(sources, [], [])
        if sock.fileno() in ready:
            data = sock.recv(1 << 16)
            if not data:
                return
            os.write(out, data)
        if stdin_fd in ready:
            data = os.read(stdin_fd, 1 << 16)
            if data:
                sock.sendall(data)
            else:  # our input ended: tell pdb (it lets the rank run on), and read on until it hangs up
                sock.shutdown(socket.SHUT_WR)
                sources.remove(stdin_fd)


def main(argv: Sequence[str] | None = None) -> int:
    """Connect to ``HOST:PORT`` (the line the rank printed) and bridge the terminal to it."""
    args = sys.argv[1:] if argv is None else list(argv)
    host, sep, port = args[0].rpartition(":") if len(args) == 1 else ("", "", "")
    if not sep or not port.isdigit():
        print("usage: python -m mirage_tui.debug_client HOST:PORT (as the rank's 'waits for a debugger' line "
              "names it)", file=sys.stderr)
        return 2
    try:
        sock = socket.create_connection((host, int(port)))
    except OSError as e:
        print(f"debug_client: cannot connect to {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    with sock:
        try:
            bridge(sock, sys.stdin.fileno(), sys.stdout.fileno())
        except KeyboardInterrupt:
            return 130
        except OSError as e:  # the rank died under us
            print(f"debug_client: connection lost: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
