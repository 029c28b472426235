"""Compile every Triton kernel to a CUDA cubin (sm_80) without a GPU; run as a script by the tests.

Must run without TRITON_INTERPRET (then @triton.jit yields compilable functions). Prints one line
per compiled kernel and exits non-zero on the first failure.
"""

from __future__ import annotations

import inspect

import triton
from pagedserve.kernels.triton.activation import _silu_and_mul_kernel
from pagedserve.kernels.triton.cache import _reshape_and_cache_kernel
from pagedserve.kernels.triton.decode_attention import (
    _decode_kernel,
    _decode_reduce_kernel,
)
from pagedserve.kernels.triton.gguf_linear import _QS_OFFSET, _gguf_linear_kernel
from pagedserve.kernels.triton.norm import _rms_norm_kernel
from pagedserve.kernels.triton.prefill_attention import _prefill_kernel
from pagedserve.kernels.triton.rotary import _rotary_kernel
from pagedserve.kernels.triton.sampling import _mask_kernel, _masked_exp_sum_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 80, 32)


def compile_kernel(fn, pointers: dict[str, str], floats: set[str], constexprs: dict[str, object]) -> None:
    """Arguments not named in pointers/floats/constexprs are i32 scalars."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    consts = {(names.index(k),): v for k, v in constexprs.items()}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts), target=TARGET)
    assert compiled.asm.get("cubin"), fn.fn.__name__
    print(f"compiled {fn.fn.__name__} {constexprs}", flush=True)


def attention_pointers(dtype: str) -> dict[str, str]:
    return {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32"}


def main() -> None:
    cases = (("bf16", "tf32", True, True, 128), ("fp32", "ieee", False, False, 80))
    for dtype, precision, window, parts, head in cases:
        block_d = triton.next_power_of_2(head)
        compile_kernel(_decode_kernel, attention_pointers(dtype), {"scale"}, dict(
            BLOCK_SIZE=16, TILE_BLOCKS=4, BLOCK_G=16, BLOCK_D=block_d, PARTITION_BLOCKS=32, USE_PARTITIONS=parts,
            HAS_WINDOW=window, INTERPRET=False, DOT_PRECISION=precision))
        compile_kernel(_prefill_kernel, attention_pointers(dtype), {"scale"}, dict(
            BLOCK_M=16, BLOCK_G=4, BLOCK_SIZE=32, TILE_BLOCKS=2, BLOCK_D=block_d, HAS_WINDOW=window, INTERPRET=False,
            DOT_PRECISION=precision))
    compile_kernel(_decode_reduce_kernel, {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
                                           "out_ptr": "*bf16", "seq_lens_ptr": "*i32"}, set(),
                   dict(PARTITION_TOKENS=512, BLOCK_G=16, BLOCK_D=128, BLOCK_P=4))
    compile_kernel(_reshape_and_cache_kernel, {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
                                               "value_cache_ptr": "*bf16", "slot_ptr": "*i64"},
                   set(), dict(BLOCK_H=8, BLOCK_D=128))
    compile_kernel(_rms_norm_kernel, {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
                                      "out_ptr": "*bf16", "residual_out_ptr": "*bf16"},
                   {"eps"}, dict(HAS_RESIDUAL=True, BLOCK=4096))
    compile_kernel(_rotary_kernel, {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "q_out_ptr": "*bf16",
                                    "k_out_ptr": "*bf16", "cache_ptr": "*fp32"},
                   set(), dict(IS_NEOX=False, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64))
    for qtype, block_bytes, elems, dtype, out, precision, block_m in (
            (3, 20, 32, "bf16", "bf16", "tf32", 16), (7, 24, 32, "fp16", "fp32", "tf32", 64),
            (8, 34, 32, "fp32", "fp32", "ieee", 32), (13, 176, 256, "bf16", "fp32", "tf32", 16),
            (14, 210, 256, "bf16", "bf16", "tf32", 64), (12, 144, 256, "fp16", "fp16", "tf32", 32),
            (3, 20, 32, "bf16", "bf16", "tf32", 128)):
        compile_kernel(_gguf_linear_kernel, {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "out_ptr": f"*{out}"}, set(), dict(
            QTYPE=qtype, BLOCK_BYTES=block_bytes, BLOCK_ELEMS=elems, QS_OFFSET=_QS_OFFSET[qtype], BLOCK_M=block_m,
            BLOCK_N=32, BLOCK_K=256 if elems == 256 else 128, PRECISION=precision,
            INTERPRET=False))
    compile_kernel(_silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, set(), dict(BLOCK=1024))
    compile_kernel(_masked_exp_sum_kernel, {"logits_ptr": "*fp32", "rows_ptr": "*i64", "kth_ptr": "*fp32",
                                            "max_ptr": "*fp32", "out_ptr": "*fp32"}, set(), dict(BLOCK=1024))
    compile_kernel(_mask_kernel, {"logits_ptr": "*fp32", "out_ptr": "*fp32", "thr_ptr": "*fp32",
                                  "min_p_ptr": "*fp32"}, set(), dict(HAS_MIN_P=True, BLOCK=1024))


if __name__ == "__main__":
    main()
