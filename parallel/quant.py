"""GGUF block-quantized weights in the tensor-parallel layers (weight-only quantization).

A `QuantConfig` says which checkpoint weights a layer keeps quantized and in which format (vLLM's
``quant_config``): `GGUFQuantConfig` those a GGUF file stores quantized, `RTNQuantConfig` every linear
layer of a float checkpoint, quantized at load (round-to-nearest, 32-element groups). A layer built
with a ``qtype`` holds its weight as uint8 rows of llama.cpp blocks and multiplies through
`kernels.gguf_linear`. `QuantizedWeight` is a checkpoint tensor as the GGUF loader hands it over: raw
block rows read lazily, sliced by whole rows (column-parallel, vocabulary shards) or by whole blocks
(32 elements; 256 for the K-quants) along the input dimension (row-parallel), and dequantized only when
a layer keeps float weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pagedserve.kernels.torch_impl.gguf_quant import GGUF_QUANT_TYPES, block_elements, dequantize_gguf, row_bytes

logger = logging.getLogger(__name__)


class QuantConfig(Protocol):
    def qtype(self, *names: str, in_features: int | None = None) -> str | None:
        """The quant type a layer loading the checkpoint weights ``names`` (``in_features`` wide) keeps;
        None: float weights."""
        ...


@dataclass(frozen=True)
class GGUFQuantConfig:
    """HF weight name -> GGML quant type, for the checkpoint's weights stored in a supported quant type."""

    weight_types: Mapping[str, str] = field(default_factory=dict)

    def qtype(self, *names: str, in_features: int | None = None) -> str | None:
        """The quant type the weights ``names`` (the parts of one, possibly fused, layer) share; None keeps
        the layer in floats: a part is not quantized, or the parts differ (a fused matmul has one format)."""
        types = {self.weight_types.get(name) for name in names}
        if len(types) != 1:
            logger.debug("pagedserve: %s are stored in different formats (%s); that layer runs dequantized",
                        ", ".join(names), ", ".join(sorted(str(t) for t in types)))
            return None
        return types.pop()


@dataclass(frozen=True)
class RTNQuantConfig:
    """Weight-only quantization of a float checkpoint at load: every linear layer's weight becomes
    ``qtype`` blocks (Q8_0: int8, Q4_1: int4 with a min per group); the embedding and LM head stay float.
    A layer whose input width is not a whole number of groups stays float too, as llama.cpp's quantizer
    falls back for such tensors (one warning per width): the checkpoint's shape is not the user's to change."""

    weight_type: str
    _warned_widths: set[int] = field(default_factory=set, compare=False, repr=False)

    def qtype(self, *names: str, in_features: int | None = None) -> str | None:
        if not all(name.endswith("_proj.weight") for name in names):
            return None
        group = block_elements(self.weight_type)
        if in_features is not None and in_features % group:
            if in_features not in self._warned_widths:
                self._warned_widths.add(in_features)
                logger.warning("pagedserve: linear layers %s wide are not a whole number of %d-weight groups; "
                               "they stay in floats, not %s (first: %s)", in_features, group, self.weight_type,
                               ", ".join(names))
            return None
        return self.weight_type


def qtype_of(quant_config: QuantConfig | None, *names: str, in_features: int | None = None) -> str | None:
    """The quant type `quant_config` gives the layer of checkpoint weights ``names`` whose input is
    ``in_features`` wide (None when unknown); None: float weights."""
    return None if quant_config is None else quant_config.qtype(*names, in_features=in_features)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized checkpoint tensor [rows, cols] as raw block rows (uint8 [rows, cols / 32 * block bytes],
    a numpy memory map or array); nothing is read until `tensor` or `dequantize`."""

    raw: Any
    qtype: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype not in GGUF_QUANT_TYPES:
            raise ValueError(f"qtype: {self.qtype!r} is not a supported GGUF quant type")
        if tuple(self.raw.shape) != (self.shape[0], row_bytes(self.qtype, self.shape[1])):
            raise ValueError(f"{self.qtype} tensor of shape {self.shape} cannot be stored in {tuple(self.raw.shape)} bytes")

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def __getitem__(self, index: slice | tuple[slice, ...]) -> QuantizedWeight | torch.Tensor:
        """Rows and columns (elements) by slices; a column range that splits a block comes back dequantized."""
        rows, cols = ((index if isinstance(index, tuple) else (index,)) + (slice(None),) * 2)[:2]
        r0, r1, rstep = rows.indices(self.shape[0])
        c0, c1, cstep = cols.indices(self.shape[1])
        if rstep != 1 or cstep != 1:
            raise ValueError("QuantizedWeight: only contiguous slices are supported")
        elements = block_elements(self.qtype)
        if c0 % elements or c1 % elements:
            return self[r0:r1].dequantize(torch.float32)[:, c0:c1]
        bb = GGUF_QUANT_TYPES[self.qtype][1]
        raw = self.raw[r0:r1, c0 // elements * bb : c1 // elements * bb]
        return QuantizedWeight(raw, self.qtype, (max(r1 - r0, 0), max(c1 - c0, 0)))

    def take_rows(self, order: np.ndarray) -> QuantizedWeight:
        """Rows in ``order`` (a permutation, e.g. undoing llama.cpp's Q/K layout): block rows move whole."""
        return QuantizedWeight(np.asarray(self.raw)[order], self.qtype, (len(order), self.shape[1]))

    def tensor(self) -> torch.Tensor:
        """The raw block rows as a uint8 tensor (read now)."""
        return torch.from_numpy(np.array(self.raw, dtype=np.uint8, copy=True))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_gguf(self.tensor(), self.qtype, dtype)


def quantized_param_shape(rows: int, in_features: int, qtype: str) -> tuple[int, int]:
    return rows, row_bytes(qtype, in_features)
