"""Processes on each host: starting and stopping programs and daemons, on the session's host and, in a
multi-host run, through each host's agent (its protocol, the head's side, the network interface).
"""
