"""mirage's console: the ``mirage`` command line, batch runs and (later) the TUI."""

__version__ = "0.1.0"
