"""What each device's kernels can run, decided from plain inputs so it is testable without a GPU.

- block_size: CUDA's Triton attention kernels need a power of two in [16, 256]: 16 because
  the second `tl.dot` (probabilities @ V) takes the block as its K dimension, which must
  be >= 16 for bf16/fp16 tensor cores; 256 because one block's K and V tiles
  (block_size x head_size, pipelined) must fit in shared memory: compiled for sm_90 with
  bf16 and head size 256, prefill needs 160 KiB at 256 (fits an A100's 163 KiB) and
  304 KiB at 512 (fits nothing); the decode launcher's split-K partition caps it at 512
  in any case. The CPU twins walk blocks of any size: a power of two in [1, 1024].
- dtype "auto": the checkpoint's dtype, except that an fp32 checkpoint runs in bf16 on CUDA
  (fp16 where the GPU lacks bf16), as vLLM does; the CPU keeps fp32.
- Triton warm-up at start-up runs on CUDA only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports this module: keep torch out of its import
    import torch

logger = logging.getLogger(__name__)

BLOCK_SIZE_RANGE: dict[str, tuple[int, int]] = {"cuda": (16, 256), "cpu": (1, 1024)}


def check_block_size(block_size: int, device_type: str) -> None:
    """ValueError naming block_size and the device's allowed range unless its kernels run it."""
    low, high = BLOCK_SIZE_RANGE.get(device_type, BLOCK_SIZE_RANGE["cpu"])
    if block_size < low or block_size > high or block_size & (block_size - 1):
        raise ValueError(
            f"block_size: {block_size} is not supported on {device_type}; "
            f"use a power of two in [{low}, {high}]"
        )


def auto_dtype(checkpoint_dtype: torch.dtype, device_type: str, bf16_supported: bool) -> torch.dtype:
    """The dtype dtype="auto" runs in for a checkpoint saved in `checkpoint_dtype` on `device_type`."""
    import torch

    if device_type != "cuda" or checkpoint_dtype != torch.float32:
        return checkpoint_dtype
    chosen = torch.bfloat16 if bf16_supported else torch.float16
    logger.info("dtype='auto': the checkpoint is float32; running in %s on CUDA (pass dtype='float32' to keep it)",
                str(chosen).removeprefix("torch."))
    return chosen


def should_warm_up(device: torch.device) -> bool:
    """Compile every Triton kernel variant before serving: only where Triton kernels run."""
    return device.type == "cuda"
