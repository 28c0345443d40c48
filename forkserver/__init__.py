"""The fork server: one process per machine that has imported torch once and forks each rank from it.

A rank started by any launcher (torchrun, ``mp.spawn``, Lightning, the session
itself) begins as a small Python process whose ``sitecustomize`` hands its
argv, environment, working directory, open files and signal dispositions over
to the server (:mod:`forkserver.handover`), then forwards signals to the forked
rank and exits with its status. The server (:mod:`forkserver.server`) forks,
and the child becomes that process (:mod:`forkserver.program`) and runs the
program as ``python`` would have. What crosses the socket is in
:mod:`forkserver.protocol`. docs/scaling.md, *Starting ranks*, says what it
saves and what differs from a fresh interpreter.

The stub's side imports only the standard library: it runs in every Python
process of a session before anything else.
"""
