"""Large CPU tensors on memory the kernel may back with 2 MiB pages.

The KV cache is read in a scattered order (one block here, the next far away); with 4 KiB pages nearly
every token row of a decode step is a TLB miss. On benchmarks/kernels.py (fp32, one thread) moving the
cache onto huge pages took the compiled decode op from 1.34x to 1.06x of dense SDPA's time (before later
changes to the op). Anonymous mmap memory comes zero-filled, so the result is also a valid torch.zeros.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def empty_hugepage_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, resident CPU tensor on anonymous memory advised MADV_HUGEPAGE (plain pages where
    the platform has no such advice, or for tensors under one huge page)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Round up to whole huge pages so the tail is as eligible as the rest; the view covers nbytes.
    # MAP_PRIVATE: the default shared anonymous mapping is shmem, which THP's madvise mode leaves alone.
    buf = mmap.mmap(-1, -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or forbidden: plain pages still work
        pass
    # frombuffer keeps `buf` alive for as long as the tensor (and its views) live.
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    # Fault every page in now (one write per base page; the kernel zero-fills it, 2 MiB at a time where a
    # huge page was granted): otherwise the first step to touch each block pays for the fault, ~0.5 ms
    # per step measured when the block pool walks into fresh memory.
    flat[:: mmap.PAGESIZE] = 0
    return flat.view(dtype).view(shape)
