"""``cuda:i`` tensors: the wrapper subclass around a host tensor, and what torch asks of it (identity
across ``.data =``, saving and loading, the C++ fast path for views and common ops).
"""
