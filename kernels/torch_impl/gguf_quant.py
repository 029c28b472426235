"""GGUF (llama.cpp) block-quantized weights in pure torch: the formats, dequantization, and the linear twin.

A quantized weight [N, K] is kept as llama.cpp stores it: a uint8 tensor [N, K / block * block_bytes],
each row a run of blocks. Per 32-element block (little endian, scales in float16):

    Q4_0  d, 16 bytes of nibbles             w = d * (q - 8)
    Q4_1  d, m, 16 bytes of nibbles          w = d * q + m
    Q5_0  d, 32 high bits, 16 bytes nibbles  w = d * (q - 16)
    Q5_1  d, m, 32 high bits, 16 bytes       w = d * q + m
    Q8_0  d, 32 int8                         w = d * q

Nibble byte j holds element j (low half) and element j + 16 (high half); high bit j of Q5 is element j's
fifth bit. The K-quants pack 256-element super-blocks of eight 32-element sub-blocks (Q6_K: sixteen
16-element groups), each with its own scale (and min) quantized against the super-block's d (dmin):

    Q4_K  d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles    w = d*sc * q - dmin*m
    Q5_K  d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128   w = d*sc * q - dmin*m
    Q6_K  128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d      w = d*sc * (q - 32)

The arithmetic is the `gguf` package's, operation for operation (float32 scales, a product, then the
offset), so these dequantize to the same bits as `gguf.quants.dequantize`.

`gguf_linear_torch` is the reference and the fallback of the compiled CPU op and of the Triton kernel:
it dequantizes a tile of rows at a time and multiplies, never the whole matrix at once.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available

QK = 32  # elements per block of the simple types, and per sub-block of the K-quants
QK_K = 256  # elements per K-quant super-block
# GGML type name -> (GGMLQuantizationType value, bytes per block, elements per block)
GGUF_QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 18, QK),
    "Q4_1": (3, 20, QK),
    "Q5_0": (6, 22, QK),
    "Q5_1": (7, 24, QK),
    "Q8_0": (8, 34, QK),
    "Q4_K": (12, 144, QK_K),
    "Q5_K": (13, 176, QK_K),
    "Q6_K": (14, 210, QK_K),
}
# Rows of the weight dequantized at once by the twin (bounded scratch: TILE_ELEMENTS floats).
TILE_ELEMENTS = 1 << 20


def block_bytes(qtype: str) -> int:
    if qtype not in GGUF_QUANT_TYPES:
        raise ValueError(f"qtype: {qtype!r} is not a supported GGUF quant type; supported: {', '.join(GGUF_QUANT_TYPES)}")
    return GGUF_QUANT_TYPES[qtype][1]


def block_elements(qtype: str) -> int:
    block_bytes(qtype)  # validates the name
    return GGUF_QUANT_TYPES[qtype][2]


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one quantized row of ``in_features`` elements (a whole number of blocks)."""
    elements = block_elements(qtype)
    if in_features % elements:
        raise ValueError(f"in_features: {in_features} is not a multiple of the {qtype} block size {elements}")
    return in_features // elements * block_bytes(qtype)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32 [..., nb, 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> 32 values: the low nibbles (elements 0-15), then the high ones (16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _shifted(q: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """q [..., n] -> [..., len(shifts), n]: (q >> s) & mask for each shift."""
    return torch.stack([(q >> s) & mask for s in shifts], dim=-2)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes per super-block -> eight 6-bit scales and eight 6-bit mins (uint8 [..., 8])."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dequantize_k(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """K-quant super-blocks [..., nb, bytes] -> float32 [..., nb, 256]."""
    if qtype == "Q6_K":
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        d = (_f16(blocks, 208) * scales).unsqueeze(-1)  # [..., nb, 16, 1]
        lead = blocks.shape[:-1]
        ql = _shifted(blocks[..., :128].reshape(*lead, 2, 64), [0, 4], 0x0F).reshape(*lead, 8, 32)
        qh = _shifted(blocks[..., 128:192].reshape(*lead, 2, 32), [0, 2, 4, 6], 0x03).reshape(*lead, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(*lead, 16, 16).float()
        return (d * q).reshape(*lead, QK_K)
    lead = blocks.shape[:-1]
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    d = (_f16(blocks, 0) * sc.float()).unsqueeze(-1)  # [..., nb, 8, 1]
    dm = (_f16(blocks, 2) * mn.float()).unsqueeze(-1)
    if qtype == "Q4_K":
        q = _shifted(blocks[..., 16:].reshape(*lead, 4, 32), [0, 4], 0x0F).reshape(*lead, 8, 32)
    else:  # Q5_K
        ql = _shifted(blocks[..., 48:].reshape(*lead, 4, 32), [0, 4], 0x0F).reshape(*lead, 8, 32)
        qh = _shifted(blocks[..., 16:48], list(range(8)), 0x01)  # [..., nb, 8, 32]: bit i of byte l
        q = ql | (qh << 4)
    return (d * q.float() - dm).reshape(*lead, QK_K)


def _high_bits(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5's 32 fifth bits (a little-endian uint32 at ``offset``) as 0/16 per element [..., nb, 32]."""
    qh = blocks[..., offset : offset + 4].to(torch.int64)
    word = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
    shifts = torch.arange(QK, device=blocks.device)
    return (((word.unsqueeze(-1) >> shifts) & 1) << 4).to(torch.uint8)


def dequantize_gguf(raw: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A uint8 tensor [..., nb * block_bytes] of ``qtype`` rows -> [..., nb * 32] of ``dtype``."""
    bb = block_bytes(qtype)
    if raw.dtype != torch.uint8 or raw.shape[-1] % bb:
        raise ValueError(f"weight: expected uint8 rows of whole {qtype} blocks ({bb} bytes), got "
                         f"{raw.dtype} with {raw.shape[-1]} bytes per row")
    lead = raw.shape[:-1]
    width = raw.shape[-1] // bb * block_elements(qtype)  # named, not -1: no rows (lead has a 0) is valid
    blocks = raw.reshape(*lead, raw.shape[-1] // bb, bb)
    if qtype.endswith("_K"):
        return _dequantize_k(blocks, qtype).reshape(*lead, width).to(dtype)
    d = _f16(blocks, 0)
    if qtype == "Q8_0":
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    elif qtype == "Q4_0":
        w = d * (_nibbles(blocks[..., 2:]).to(torch.int8) - 8).float()
    elif qtype == "Q4_1":
        w = d * _nibbles(blocks[..., 4:]).float() + _f16(blocks, 2)
    elif qtype == "Q5_0":
        q = _nibbles(blocks[..., 6:]) | _high_bits(blocks, 2)
        w = d * (q.to(torch.int8) - 16).float()
    else:  # Q5_1
        q = _nibbles(blocks[..., 8:]) | _high_bits(blocks, 4)
        w = d * q.float() + _f16(blocks, 2)
    return w.reshape(*lead, width).to(dtype)


def gguf_linear_torch(x: torch.Tensor, weight: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """x [..., K] @ dequantize(weight [N, K/32 * block_bytes]).T -> [..., N] in x.dtype, a row tile at a time."""
    rows = weight.shape[0]
    tile = max(1, TILE_ELEMENTS // max(in_features, 1))
    x2 = x.reshape(-1, in_features)
    if rows <= tile:
        out = x2 @ dequantize_gguf(weight, qtype, x.dtype).t()
    else:
        out = torch.empty(x2.shape[0], rows, dtype=x.dtype, device=x.device)
        for start in range(0, rows, tile):
            w = dequantize_gguf(weight[start : start + tile], qtype, x.dtype)
            torch.mm(x2, w.t(), out=out[:, start : start + w.shape[0]])
    return out.reshape(*x.shape[:-1], rows)


# Activation / result dtypes the compiled GGUF ops (kernels/cpu/gguf_linear.cpp) take.
COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gguf_linear_cpu(x: torch.Tensor, weight: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The CPU path: the compiled op (kernels/cpu/gguf_linear.cpp) where it built, else the twin."""
    if x.dtype in COMPILED_DTYPES and cpu_ops_available():
        return torch.ops.pagedserve.gguf_linear(x, weight, GGUF_QUANT_TYPES[qtype][0], in_features)
    return gguf_linear_torch(x, weight, qtype, in_features)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf, as llama.cpp and the gguf package quantize)."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.half().view(torch.uint8)


# Types `quantize_gguf` writes: weight-only round-to-nearest quantization of float checkpoints at load.
RTN_TYPES = ("Q8_0", "Q4_1")


def quantize_gguf(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Float rows [..., K] -> uint8 ``qtype`` block rows [..., K / 32 * block_bytes], by round-to-nearest
    per 32-element group, operation for operation as llama.cpp / `gguf.quants.quantize` (same bytes):
    Q8_0 symmetric (d = absmax / 127), Q4_1 asymmetric (d = (max - min) / 15, m = min)."""
    if qtype not in RTN_TYPES:
        raise ValueError(f"qtype: quantizing to {qtype!r} is not supported; supported: {', '.join(RTN_TYPES)}")
    row_bytes(qtype, w.shape[-1])  # validates the width
    lead = w.shape[:-1]
    blocks = w.float().reshape(*lead, w.shape[-1] // QK, QK)
    if qtype == "Q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        qs = _roundf(blocks * inv).to(torch.int8).view(torch.uint8)
        out = torch.cat([_f16_bytes(d), qs], dim=-1)
    else:  # Q4_1
        hi = blocks.amax(dim=-1, keepdim=True)
        lo = blocks.amin(dim=-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        qs = ((blocks - lo) * inv + 0.5).trunc().to(torch.uint8).clamp(0, 15)
        packed = qs[..., : QK // 2] | (qs[..., QK // 2 :] << 4)
        out = torch.cat([_f16_bytes(d), _f16_bytes(lo), packed], dim=-1)
    return out.reshape(*lead, -1)
