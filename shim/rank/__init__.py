"""The rank process itself: its connection to the daemon, its output files and ``--debug-rank``'s
debugger.
"""
