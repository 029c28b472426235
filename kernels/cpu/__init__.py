"""Compiled CPU ops (C++ built on first use with torch.utils.cpp_extension) and huge-page KV memory.

They back the CPU twins (kernels.torch_impl) where a torch-op composition pays for copies a hand loop
avoids: paged decode attention reads K/V rows in place instead of gathering blocks. The twins' pure-torch
paths stay the fallback (no C++ compiler) and the reference the compiled ops are tested against.
"""

from pagedserve.kernels.cpu.build import cpu_ops_available, load_cpu_ops
from pagedserve.kernels.cpu.memory import empty_hugepage_tensor

__all__ = ["cpu_ops_available", "empty_hugepage_tensor", "load_cpu_ops"]
