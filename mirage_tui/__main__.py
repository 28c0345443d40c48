"""``python -m mirage_tui`` runs the ``mirage`` command."""

import sys

from mirage_tui.cli import main

if __name__ == "__main__":
    sys.exit(main())
