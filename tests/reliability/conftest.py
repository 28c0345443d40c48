"""Set-up for the reliability suite (issue 8): bad input, faults, untrusted clients, load.

The helpers of the parent ``tests/`` folder (``daemon_client``, ``test_run``'s
``mirage_run``) are imported from here; ``no_orphans`` comes from
``tests/conftest.py``, which pytest applies to this folder too.
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
