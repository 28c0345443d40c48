"""A session owns every process of one run: the daemon, the node processes, their children.

It creates the run directory, starts the daemon and waits until it answers,
starts one process per emulated node (or, with ``--nproc-per-node``, that many
rank processes per node, as torchrun would) with the environment the shim reads,
gathers every event (daemon events from ZeroMQ, output lines from the rank
files and node pipes) into one ordered stream that goes to ``events.jsonl``
and to the caller's sink, and tears everything down at the end: nodes first,
the daemon last, then anything still carrying the session's id.

Each part owns its state: :mod:`.journal` the event stream, the journal and the
fold; :mod:`.daemon` the emulator daemon and its sockets; :mod:`.launcher` the
command's processes; :mod:`.lifecycle` holds :class:`Session`, which starts them
in order, waits for the run's end and tears down. What stands on its own lives
outside the package: the environment a process gets
(:mod:`~mirage_tui.config.launch_env`), starting and stopping processes
(:mod:`~mirage_tui.hosts.processes`), other hosts (:mod:`~mirage_tui.hosts.head`), hang
reports (:mod:`~mirage_tui.reports.diagnosis`).
"""

from mirage_tui.session.daemon import LaunchError
from mirage_tui.session.lifecycle import Session

__all__ = ["LaunchError", "Session"]
