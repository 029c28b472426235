"""What each device's kernels can run, decided from plain inputs so it is testable without a GPU.

- block_size: CUDA's Triton attention kernels need a power of two in [16, 256]: 16 because
  the second `tl.dot` (probabilities @ V) takes the block as its K dimension, which must
  be >= 16 for bf16/fp16 tensor cores; 256 because one block's K and V tiles
  (block_size x head_size, pipelined) must fit in shared memory: compiled for sm_90 with
  bf16 and head size 256, prefill needs 160 KiB at 256 (fits an A100's 163 KiB) and
  304 KiB at 512 (fits nothing); the decode launcher's split-K partition caps it at 512
  in any case. The CPU twins walk blocks of any size: a power of two in [1, 1024].
- dtype "auto": the checkpoint's dtype, except that an fp32 checkpoint (GGUF files count as fp32,
  quantized ones included) runs in bf16 on CUDA (fp16 where the GPU lacks bf16), as vLLM does, and on a
  CPU with native bf16 matmuls (AVX-512 BF16 or AMX-BF16: oneDNN runs bf16 at least as fast as fp32);
  a CPU without them (AVX2 only) emulates bf16, about 3x slower than fp32, so there fp32 stays.
- Triton warm-up at start-up runs on CUDA only.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
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


def cpu_capabilities() -> dict[str, object]:
    """This CPU's features as torch reports them (torch.cpu.get_capabilities), else /proc/cpuinfo's flags."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return dict(get())
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return {}
    return {flag: True for flag in flags.split(":", 1)[1].split()}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX-BF16) rather than emulating it, and
    torch runs its AVX-512 kernels here (`torch.backends.cpu.get_cpu_capability()`): where torch dispatches
    to AVX2 or below (an older CPU, or `ATEN_CPU_CAPABILITY` held lower) its bf16 ops are emulated."""
    import torch

    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    caps = cpu_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


@functools.lru_cache(maxsize=None)
def _log_choice(message: str) -> None:
    """Log each dtype decision once per process (every rank and model loader asks)."""
    logger.info(message)


def auto_dtype(checkpoint_dtype: torch.dtype, device_type: str, bf16_supported: bool) -> torch.dtype:
    """The dtype dtype="auto" runs in for a checkpoint saved in `checkpoint_dtype` on `device_type`.
    ``bf16_supported``: the GPU has bf16 (CUDA), or the CPU multiplies bf16 natively (cpu_has_native_bf16)."""
    import torch

    if checkpoint_dtype != torch.float32:
        return checkpoint_dtype
    if device_type == "cuda":
        chosen = torch.bfloat16 if bf16_supported else torch.float16
        _log_choice(f"dtype='auto': the checkpoint is float32; running in {str(chosen).removeprefix('torch.')} on "
                    "CUDA (pass dtype='float32' to keep it)")
        return chosen
    chosen = torch.bfloat16 if bf16_supported else torch.float32
    why = ("this CPU multiplies bf16 natively (AVX-512 BF16 / AMX)" if bf16_supported
           else "this CPU has no native bf16 matmul (no AVX-512 BF16 or AMX), where bf16 is emulated and slower")
    _log_choice(f"dtype='auto': float32 / quantized checkpoint on CPU: running in {str(chosen).removeprefix('torch.')}, "
                f"as {why}; pass dtype explicitly to override")
    return chosen


def should_warm_up(device: torch.device) -> bool:
    """Compile every Triton kernel variant before serving: only where Triton kernels run."""
    return device.type == "cuda"
