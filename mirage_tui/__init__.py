"""mirage's console: the ``mirage`` command line, the session that owns a run's processes, batch runs and the TUI."""

__version__ = "0.1.0"
