"""What the daemon, the shim and the console share: the wire format and the models all three read.

numpy and the standard library only; it imports none of the components (a contract in
``pyproject.toml``), so each can import it without pulling in another.
"""
