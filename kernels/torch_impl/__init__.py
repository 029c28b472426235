"""Torch twins of the Triton kernels: the CPU production path and the tests' reference."""
