"""The emulated GPUs' per-process state: how many, which is current, their profile, their random
generators, autocast, and kernel errors deferred to where backward was called.
"""
