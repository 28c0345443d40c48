"""Compilation on the emulated GPUs: ``torch.compile`` (dynamo, AOTAutograd, inductor) and Triton's
interpreter over host memory.
"""
