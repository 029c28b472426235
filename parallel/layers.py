"""Tensor-parallel linear and embedding layers.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
attribute. ``loaded_weight`` is the full checkpoint tensor *or* a lazy handle
that supports ``get_shape()`` and slicing (a safetensors ``get_slice`` result,
a GGUF `QuantizedWeight`); the loader slices out only this rank's shard before
reading, so a rank never materialises the full weight.

A layer built with ``qtype`` (a GGUF quant type, see `parallel.quant`) keeps its
weight quantized: uint8 block rows [rows, in_features / block * block bytes], sliced
by rows (column-parallel, vocabulary shards) or by whole blocks along the input
(row-parallel), multiplied by `kernels.gguf_linear`. Without ``qtype`` a quantized
checkpoint tensor is dequantized (this rank's slice only) into the float weight.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.parallel.communication import tp_all_gather, tp_all_reduce
from pagedserve.kernels.torch_impl.gguf_quant import RTN_TYPES, block_elements, quantize_gguf
from pagedserve.parallel.quant import QuantizedWeight, quantized_param_shape
from pagedserve.parallel.state import ParallelContext

WeightLoader = Callable[..., None]


def _shape(w: Any) -> tuple[int, ...]:
    return tuple(w.get_shape()) if hasattr(w, "get_shape") else tuple(w.shape)


def _read(w: Any, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
    """Read ``w[..., start:start+length, ...]`` along ``dim`` (the whole tensor if dim is None)."""
    shape = _shape(w)
    if dim is None:
        index: tuple[slice, ...] = tuple(slice(None) for _ in shape)
    else:
        if length is None:
            length = shape[dim] - start
        if start < 0 or start + length > shape[dim]:
            raise ValueError(f"shard [{start}, {start + length}) out of range for dim {dim} of shape {shape}")
        index = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(shape)))
    t = w[index]
    return t if isinstance(t, (torch.Tensor, QuantizedWeight)) else torch.as_tensor(t)


def _copy(param: torch.Tensor, loaded: torch.Tensor | QuantizedWeight, what: str, qtype: str | None = None) -> None:
    """Copy a checkpoint shard into ``param``: quantized blocks as they are into a quantized (``qtype``)
    parameter, dequantized into a float one; a float shard into a quantized parameter is quantized
    (round-to-nearest, `RTN_TYPES`: the rank's own slice, so its groups are the layer's)."""
    if isinstance(loaded, QuantizedWeight):
        if qtype is None:
            loaded = loaded.dequantize(param.dtype)
        elif loaded.qtype != qtype:
            raise ValueError(f"{what}: checkpoint weight is {loaded.qtype}, the layer was built for {qtype}")
        else:
            loaded = loaded.tensor()
    elif qtype in RTN_TYPES:
        loaded = quantize_gguf(loaded, qtype)
    elif qtype is not None:
        raise ValueError(f"{what}: the layer keeps {qtype} weights but the checkpoint gives {loaded.dtype} floats")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shard shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.to(dtype=param.dtype))


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) must be divisible by tp_size ({d})")
    return n // d


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _weight(rows: int, in_features: int, dtype: torch.dtype, qtype: str | None, loader: WeightLoader) -> nn.Parameter:
    """A [rows, in_features] weight: floats of ``dtype``, or uint8 block rows of ``qtype``."""
    if qtype is None:
        return _param((rows, in_features), dtype, loader)
    return _param(quantized_param_shape(rows, in_features, qtype), torch.uint8, loader)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qtype: str | None,
            in_features: int) -> torch.Tensor:
    if qtype is None:
        return F.linear(x, weight, bias)
    y = kernels.gguf_linear(x, weight, qtype, in_features)
    return y if bias is None else y + bias


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output rows; each rank computes its slice of y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        gather_output: bool = False,
        qtype: str | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = _divide(output_size, parallel.tp_size, "output_size")
        self.gather_output = gather_output
        self.qtype = qtype
        self.weight = _weight(self.output_size_per_rank, input_size, dtype, qtype, self.weight_loader)
        self.bias = _param((self.output_size_per_rank,), dtype, self.weight_loader) if bias else None

    def _qtype_of(self, param: nn.Parameter) -> str | None:
        return self.qtype if param is self.weight else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        n = self.output_size_per_rank
        _copy(param, _read(loaded, 0, self.parallel.tp_rank * n, n), type(self).__name__, self._qtype_of(param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x, self.weight, self.bias, self.qtype, self.input_size)
        return tp_all_gather(y, self.parallel) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (e.g. gate and up projections).

    Each logical output is split across ranks separately, so rank r holds
    [out_0 shard r; out_1 shard r; ...]. ``shard_id`` is the index of the logical output.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        qtype: str | None = None,
    ) -> None:
        for i, size in enumerate(output_sizes):
            _divide(size, parallel.tp_size, f"output_sizes[{i}]")
        super().__init__(input_size, sum(output_sizes), parallel, dtype, bias=bias, qtype=qtype)
        self.output_sizes = list(output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index into output_sizes {self.output_sizes}, got {shard_id!r}")
        tp = self.parallel.tp_size
        n = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        shard = _read(loaded, 0, self.parallel.tp_rank * n, n)
        _copy(param.data.narrow(0, offset, n), shard, f"{type(self).__name__}[{shard_id}]", self._qtype_of(param))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with grouped-query attention.

    Query heads are split across ranks. KV heads are split too when there are at
    least ``tp_size`` of them; otherwise each KV head is replicated on
    ``tp_size // num_kv_heads`` consecutive ranks. ``shard_id`` is "q", "k" or "v".
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        qtype: str | None = None,
    ) -> None:
        tp = parallel.tp_size
        heads_per_rank = _divide(num_heads, tp, "num_heads")
        if num_kv_heads >= tp:
            kv_heads_per_rank = _divide(num_kv_heads, tp, "num_kv_heads")
            kv_head_start = parallel.tp_rank * kv_heads_per_rank
        else:
            if tp % num_kv_heads != 0:
                raise ValueError(f"tp_size ({tp}) must be a multiple of num_kv_heads ({num_kv_heads})")
            kv_heads_per_rank = 1
            kv_head_start = parallel.tp_rank // (tp // num_kv_heads)
        per_rank = (heads_per_rank + 2 * kv_heads_per_rank) * head_size
        super().__init__(hidden_size, per_rank * tp, parallel, dtype, bias=bias, qtype=qtype)
        self.head_size = head_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = heads_per_rank
        self.num_kv_heads_per_rank = kv_heads_per_rank
        self.kv_head_start = kv_head_start
        self.q_size = heads_per_rank * head_size
        self.kv_size = kv_heads_per_rank * head_size

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        hs = self.head_size
        if shard_id == "q":
            offset, n, start = 0, self.q_size, self.parallel.tp_rank * self.q_size
        elif shard_id == "k":
            offset, n, start = self.q_size, self.kv_size, self.kv_head_start * hs
        elif shard_id == "v":
            offset, n, start = self.q_size + self.kv_size, self.kv_size, self.kv_head_start * hs
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        shard = _read(loaded, 0, start, n)
        _copy(param.data.narrow(0, offset, n), shard, f"{type(self).__name__}[{shard_id}]", self._qtype_of(param))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split this rank's fused output into (q, k, v)."""
        # (split_with_sizes: Tensor.split's Python wrapper costs about a microsecond per layer per step)
        return qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input columns; partial sums are all-reduced.

    The input is expected already split (the output of a column-parallel layer).
    The bias is added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        reduce_results: bool = True,
        qtype: str | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = _divide(input_size, parallel.tp_size, "input_size")
        if qtype is not None and self.input_size_per_rank % block_elements(qtype):
            block = block_elements(qtype)
            raise ValueError(
                f"tensor_parallel_size: {parallel.tp_size} would split the {block}-element {qtype} blocks of a "
                f"row-parallel weight (input_size {input_size}, {self.input_size_per_rank} per rank); use a TP size "
                f"that divides {input_size // block}, or quantization='none' to load the weights dequantized"
            )
        self.reduce_results = reduce_results
        self.qtype = qtype
        self.weight = _weight(output_size, self.input_size_per_rank, dtype, qtype, self.weight_loader)
        self.bias = _param((output_size,), dtype, self._bias_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        n = self.input_size_per_rank
        _copy(param, _read(loaded, 1, self.parallel.tp_rank * n, n), type(self).__name__, self.qtype)

    def _bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _copy(param, _read(loaded), f"{type(self).__name__}.bias")

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, before the all-reduce and the bias (LoRA adds its partial delta here)."""
        return _linear(x, self.weight, None, self.qtype, self.input_size_per_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_matmul(x)
        if self.reduce_results:
            y = tp_all_reduce(y, self.parallel)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows.

    Rank r owns ids [r * n, (r + 1) * n) with n = ceil(vocab / tp); the last
    shard is zero-padded. Each rank looks up the ids it owns, zeroes the rest,
    and the all-reduce assembles the full embeddings.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext, dtype: torch.dtype,
                 qtype: str | None = None) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.dtype = dtype
        self.qtype = qtype  # quantized rows: all-zero padding rows dequantize to zeros
        self.weight = _weight(self.num_embeddings_per_rank, embedding_dim, dtype, qtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = _shape(loaded)[0]
        if rows != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint has {rows} rows, expected vocab_size {self.num_embeddings}")
        n = max(self.vocab_end - self.vocab_start, 0)
        with torch.no_grad():
            param.zero_()
        if n:
            _copy(param.data.narrow(0, 0, n), _read(loaded, 0, self.vocab_start, n), type(self).__name__, self.qtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            return F.embedding(ids, self.weight)
        return kernels.gguf_embedding(ids, self.weight, self.qtype, self.embedding_dim, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self._lookup(input_ids)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = self._lookup(local)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split like `VocabParallelEmbedding`.

    ``compute_logits`` gathers every rank's logits so each rank returns the full vocabulary.
    """

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings); both use the same vocab split."""
        if (embedding.num_embeddings, embedding.embedding_dim) != (self.num_embeddings, self.embedding_dim):
            raise ValueError("tied embedding and LM head must have the same vocab_size and hidden size")
        self.weight = embedding.weight
        self.qtype = embedding.qtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _linear(hidden, self.weight, None, self.qtype, self.embedding_dim)
        logits = tp_all_gather(logits, self.parallel)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.compute_logits(hidden)


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Loader for replicated parameters (norm weights and the like): read the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter takes no shard_id, got {shard_id!r}")
    _copy(param, _read(loaded), "replicated parameter")
