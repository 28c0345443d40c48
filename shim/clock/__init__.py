"""Clocked mode's rank side: emulated time per stream, the roofline cost of an op, and the pricing of
compiled kernels and Triton kernels.
"""
