"""Shared pytest set-up for mirage's tests.

Kept minimal on purpose: fixtures that several test files need go here, each
in its own clearly marked section.
"""

import sys
from pathlib import Path

# ---------------------------------------------------------------- import path

#: The repository root; tests import ``emulator``, ``shim`` and ``mirage_tui``
#: from here even when the project is not pip-installed.
REPO_ROOT = Path(__file__).resolve().parent.parent

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
