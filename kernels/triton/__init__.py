"""Triton kernels (the CUDA path). Imported only from the CUDA branches of the entry points.

The tests also run them on CPU tensors under TRITON_INTERPRET=1 against the torch twins.
"""
