"""``python -m emulator``: start the daemon for one session (the session does this)."""

import argparse
import resource
import sys

from emulator.daemon import run


def _open_files_to_hard_limit() -> None:
    """Raise the soft limit on open files to the hard one: the daemon holds about three descriptors per rank
    (its socket, a pidfd, the shared buffers), ~800 at 256 ranks, and many systems' soft limit is 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # the kernel's default nr_open
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # a lower nr_open: the soft limit stays, as before
            pass


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m emulator", description="mirage emulator daemon")
    p.add_argument("--run-dir", required=True, help="the session's 0700 run directory")
    p.add_argument("--session", required=True, help="session id (names shared-memory segments)")
    p.add_argument("--token-file", required=True, help="file holding the session token (not argv: ps shows argv)")
    p.add_argument("--profile", default="mi350x")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--exec-mode", choices=["functional", "clocked", "estimate"], default="functional",
                   help="clocked, estimate: time each collective on the profile's GPUs (docs/clocked.md)")
    p.add_argument("--hang-timeout", type=float, default=30.0, help="seconds before a partly joined collective is a hang")
    p.add_argument("--listen", default="", metavar="ADDR",
                   help="also take ranks over TCP on this address, CURVE-encrypted (multi-host runs)")
    p.add_argument("--curve-secret-file", default="", help="the CURVE secret key for --listen (a 0600 file)")
    p.add_argument("--peer-listen", default="", metavar="ADDR",
                   help="a host's daemon in a multi-host run: take the other hosts' daemons' links on this address "
                        "(CURVE), for communicators across hosts")
    a = p.parse_args()
    _open_files_to_hard_limit()
    with open(a.token_file) as f:
        token = f.read().strip()
    return run(a.run_dir, a.session, token, a.profile, a.nodes, a.gpus_per_node, a.hang_timeout, a.exec_mode,
               a.listen, a.curve_secret_file, a.peer_listen)


if __name__ == "__main__":
    sys.exit(main())
