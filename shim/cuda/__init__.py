"""The ``torch.cuda`` / ``torch.accelerator`` surface of a ROCm build, the mode that translates ``cuda``
in user code, the device guard torch's C++ runtime uses, CUDA graphs and TunableOp.
"""
