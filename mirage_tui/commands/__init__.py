"""The commands that act on runs other than by starting one: ``mirage run``'s headless batch mode,
``mirage sessions`` / ``stop`` / ``exec``, ``mirage cleanup``.
"""
