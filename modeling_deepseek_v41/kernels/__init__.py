"""Numerics and kernels: the bit formats (numerics.py, the only module that knows them), the quantized and
row-invariant linears, sparse attention, and the accelerator dispatch (dispatch.py)."""
