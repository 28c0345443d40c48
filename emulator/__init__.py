"""The mirage emulator: the daemon that stands in for AMD Instinct GPUs.

It runs collectives, keeps the device ledger and models timings with numpy and
pyzmq only; it never imports torch, so it starts fast and stays out of the
ranks' way.
"""
