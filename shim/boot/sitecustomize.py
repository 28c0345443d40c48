"""Loaded by every Python process a mirage session starts (its folder is on PYTHONPATH)."""

import os
import sys

if os.environ.get("MIRAGE_SESSION") and not os.environ.get("MIRAGE_IS_FORK_SERVER"):
    _here = os.path.dirname(os.path.abspath(__file__))
    # keep the user's sys.path as it would be without us
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    if os.environ.get("MIRAGE_FORK_SERVER"):
        try:
            from forkserver.handover import hand_over
        except ImportError:  # a Python other than mirage's own: it starts as itself
            pass
        else:
            hand_over()  # returns only if this process is not one the session's fork server starts
    try:
        import shim.bootstrap
    except ImportError:
        # a Python other than mirage's own: reach the package next to this file
        sys.path.append(os.path.dirname(os.path.dirname(_here)))
        import shim.bootstrap
    shim.bootstrap.boot()
