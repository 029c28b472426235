"""CUDA graphs for decode-only steps (vLLM's "piecewise off, full decode graphs" mode, issue 15).

A decode step launches a few kernels per layer over a handful of rows, so on a GPU it is bound by
kernel launch overhead rather than by the device. At start-up we capture one CUDA graph per batch
size in `capture_sizes` (1, 2, 4, 8, 16, 24, ...) over static input buffers; a decode-only step of
n sequences then copies its inputs into the first n rows of the buffers, pads the rows up to the
smallest captured size with harmless values and replays that graph.

Padding rows are made harmless, not masked: slot -1 (the cache-write kernels skip it, so nothing
lands in the KV cache), seq_len 1 over block 0 (the decode kernel reads one cached row and its
output is discarded), position 0 and token 0. Every op of the forward is row-independent, so a
padded row never changes a real one.

What a graph bakes in is what the host decided while it was captured: kernel grids and Python-side
branches. The attention metadata's host fields are therefore set to constants for every replay of a
size (max_seq_len = max_model_len, every seq_lens_cpu entry max_model_len, so the decode launcher
picks its split-K partition count from the block-table width); the device tensors carry the real
lengths, which the decode kernel reads on the device.

`enforce_eager` (EngineConfig) turns all of this off. `run_padded_eager` runs the same fill and
padded forward without a graph, with the host fields set to the real lengths (the CPU kernels loop
over them): it is how the padding is tested on a machine without CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# The largest batch captured by default (vLLM's default max capture size): larger decode batches run
# eagerly, where launch overhead is a small share of the step anyway.
MAX_DEFAULT_CAPTURE_SIZE = 512

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def capture_sizes(max_num_seqs: int, configured: list[int] | None = None) -> list[int]:
    """The decode batch sizes to capture, ascending.

    Default: 1, 2, 4, 8, then every multiple of 8 up to min(max_num_seqs, 512), plus max_num_seqs
    itself (when <= 512) so that a full batch needs no padding beyond what the scheduler can send.
    `configured` (EngineConfig.cuda_graph_sizes) replaces the ladder; sizes above max_num_seqs are
    clipped to it.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    if configured is not None:
        if not configured or any(size < 1 for size in configured):
            raise ValueError(f"cuda_graph_sizes: every size must be a positive integer, got {configured}")
        return sorted({min(size, max_num_seqs) for size in configured})
    cap = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4, 8) if s <= cap}
    sizes.update(range(16, cap + 1, 8))
    sizes.add(cap)
    return sorted(sizes)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest size in ascending `sizes` that holds n rows, or None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphBuffers:
    """The static device inputs every graph reads, sized for the largest captured batch.

    Graphs record addresses, so these tensors are allocated once and only ever written in place.
    """

    def __init__(self, max_size: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        if max_size < 1:
            raise ValueError(f"max_size: must be >= 1, got {max_size}")
        self.max_size = max_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        # One query token per sequence: the offsets never change.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_size, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self._host_constants: dict[int, tuple[list[int], list[int]]] = {}

    def fits(self, metadata: AttentionMetadata) -> bool:
        """Whether a decode batch's block table fits the buffers (it always does for sequences within
        max_model_len; a wider one runs eagerly)."""
        return metadata.num_decodes <= self.max_size and metadata.block_tables.shape[1] <= self.max_blocks_per_seq

    def fill(
        self,
        padded: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        graph_safe: bool = True,
    ) -> AttentionMetadata:
        """Copy a decode-only batch of n = metadata.num_decodes sequences into rows [0, n) and pad rows
        [n, padded); returns the metadata of the padded batch, a view over the buffers.

        graph_safe: host fields are the per-size constants every replay of a graph shares (what the
        CUDA kernels may read on the host); False gives the real lengths (what the CPU kernels need).
        """
        n = metadata.num_decodes
        if metadata.num_seqs != n or metadata.max_query_len != 1:
            raise ValueError(f"fill: a decode-only batch is required, got {metadata.num_seqs} sequences of which "
                             f"{n} decode (max_query_len {metadata.max_query_len})")
        if input_ids.shape[0] != n or positions.shape[0] != n:
            raise ValueError(f"fill: input_ids/positions have {input_ids.shape[0]}/{positions.shape[0]} rows, "
                             f"the metadata {n} sequences")
        if not n <= padded <= self.max_size:
            raise ValueError(f"fill: padded size {padded} must be in [{n}, {self.max_size}]")
        if not self.fits(metadata):
            raise ValueError(f"fill: block table width {metadata.block_tables.shape[1]} exceeds the buffers' "
                             f"{self.max_blocks_per_seq} blocks per sequence")
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()  # a previous step's wider rows
        self._pad(n, padded)
        if graph_safe:
            return self.graph_metadata(padded)
        seq_lens_cpu = list(metadata.seq_lens_cpu) + [1] * (padded - n)
        return self._metadata(padded, max(metadata.seq_lens_cpu), self._host(padded)[0], seq_lens_cpu)

    def graph_metadata(self, padded: int) -> AttentionMetadata:
        """The metadata a graph of `padded` rows is captured and replayed with (host fields constant)."""
        query_start_loc_cpu, seq_lens_cpu = self._host(padded)
        return self._metadata(padded, self.max_model_len, query_start_loc_cpu, seq_lens_cpu)

    def pad_all(self, padded: int) -> AttentionMetadata:
        """Rows [0, padded) all padding (capture and its warm-up run write nothing to the cache)."""
        self._pad(0, padded)
        return self.graph_metadata(padded)

    def _pad(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(-1)
        self.seq_lens[start:end].fill_(1)
        self.block_tables[start:end].zero_()

    def _host(self, padded: int) -> tuple[list[int], list[int]]:
        """(query_start_loc_cpu, graph-safe seq_lens_cpu) of a size, built once (read-only)."""
        if padded not in self._host_constants:
            self._host_constants[padded] = (list(range(padded + 1)), [self.max_model_len] * padded)
        return self._host_constants[padded]

    def _metadata(
        self, padded: int, max_seq_len: int, query_start_loc_cpu: list[int], seq_lens_cpu: list[int]
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded],
            query_start_loc=self.query_start_loc[: padded + 1],
            seq_lens=self.seq_lens[:padded],
            block_tables=self.block_tables[:padded],
            num_decodes=padded,
            num_decode_tokens=padded,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )


def run_padded_eager(
    forward: Callable[..., torch.Tensor],
    kv_caches: KVCaches,
    buffers: DecodeGraphBuffers,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    padded: int,
) -> torch.Tensor:
    """The graph path without a graph: fill the buffers, run `forward` (model.forward) over all `padded`
    rows, return the first n rows of its hidden states."""
    md = buffers.fill(padded, input_ids, positions, metadata, graph_safe=False)
    hidden = forward(buffers.input_ids[:padded], buffers.positions[:padded], kv_caches, md)
    return hidden[: metadata.num_decodes]


class CUDAGraphRunner:
    """Captures and replays one decode graph per batch size for one model runner (one rank).

    Only the last-stage, first-stage case is graphed (pipeline parallelism off): the forward must take
    token ids and return hidden states. A KV connector's per-layer hooks are Python calls, so engines
    with kv_transfer_config run eagerly. `replay_eagerly` (tests) enables the runner on any device and
    makes run() take run_padded_eager instead of a graph.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: KVCaches,
        config: EngineConfig,
        device: torch.device,
        *,
        replay_eagerly: bool = False,
    ) -> None:
        self.kv_caches = kv_caches
        self.device = device
        self.replay_eagerly = replay_eagerly
        # Bound now: a caller that later wraps model.forward (tests do) must not route the graph's
        # own forward back through the wrapper.
        self._forward = model.forward
        self.enabled = (
            not config.enforce_eager
            and (device.type == "cuda" or replay_eagerly)
            and config.pipeline_parallel_size == 1
            and config.kv_transfer_config is None
            and not config.enable_lora  # a step's adapter slots are set in Python before each forward pass
            and bool(kv_caches)
        )
        self.sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes) if self.enabled else []
        self.buffers: DecodeGraphBuffers | None = None
        if self.enabled:
            max_model_len = config.max_model_len
            if max_model_len is None:
                raise ValueError("max_model_len: resolve() the config before building CUDA graphs")
            self.buffers = DecodeGraphBuffers(self.sizes[-1], max_model_len, config.block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured = False

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def can_run(
        self, num_tokens: int, metadata: AttentionMetadata, *, has_intermediate: bool = False,
        has_kv_hooks: bool = False,
    ) -> bool:
        """Whether this step may replay a graph: a decode-only batch (one token per sequence, no
        prefill chunk) of at most max_size sequences, with no pipeline input and no KV hooks."""
        return (
            self.captured
            and not has_intermediate
            and not has_kv_hooks
            and 0 < num_tokens <= self.max_size
            and metadata.max_query_len == 1
            and metadata.num_prefills == 0
            and metadata.num_decodes == num_tokens
            and self.buffers.fits(metadata)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool (the smaller graphs reuse the
        largest one's activations). Each size runs once eagerly first so every Triton kernel variant is
        compiled outside the capture. Call after the KV cache exists and before serving."""
        if not self.enabled or self.captured:
            return
        if self.replay_eagerly:
            self.captured = True
            return
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            md = self.buffers.pad_all(size)
            ids, pos = self.buffers.input_ids[:size], self.buffers.positions[:size]
            self._forward(ids, pos, self.kv_caches, md)  # warm-up: compile outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(ids, pos, self.kv_caches, md)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.captured = True
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (%s) in %.1f s, %.0f MiB",
            len(self.sizes), ", ".join(map(str, self.sizes)), time.perf_counter() - start,
            max(0, free_before - free_after) / 2**20,
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch that can_run() accepted. On CUDA this is a view of
        the graph's static output: read it before the next replay."""
        n = metadata.num_decodes
        padded = padded_size(n, self.sizes)
        if not self.captured or padded is None:
            raise ValueError(f"run: no captured graph holds {n} sequences (sizes {self.sizes}, "
                             f"captured {self.captured}); check can_run() first")
        if self.replay_eagerly:
            return run_padded_eager(self._forward, self.kv_caches, self.buffers, input_ids, positions, metadata,
                                    padded)
        self.buffers.fill(padded, input_ids, positions, metadata)
        self.graphs[padded].replay()
        return self.outputs[padded][:n]
