"""The state of a run folded from its event stream (Textual-free, one fold for every reader), its
clocked part, collective traffic, and replaying a recorded run.
"""
