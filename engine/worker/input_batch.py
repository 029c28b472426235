"""The model runner's persistent input batch: one row per live request, updated from the scheduler's diffs.

Each request the runner holds owns a row of host (numpy) matrices: its token ids
([rows, max_model_len] int32), its block table ([rows, ceil(max_model_len / block_size)] int32,
zero-padded), its token count and how many positions its KV cache holds. A step touches only the
rows that changed (new requests, appended tokens, new blocks, finished requests); the step's flat
inputs are then gathered from the matrices with a handful of vectorized numpy operations over the
scheduled rows, in the order the runner asks for (rows never move: reordering is free).

The result is exactly what `spec_decode.flat_batch.build_flat_inputs` (the draft model's builder)
builds from scratch for the same logical state (tests/test_input_batch.py checks it over random
schedules). On CUDA the host arrays are written into pinned staging buffers and copied with
`non_blocking=True`; before the next step overwrites a staging buffer it waits for the previous step's
copies (an event), so an asynchronous copy never reads a half-written buffer. On CPU the fresh numpy
arrays are wrapped without a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain

import numpy as np
import torch
from pagedserve.engine.layers.attention_metadata import AttentionMetadata

_TORCH_DTYPE = {np.int32: torch.int32, np.int64: torch.int64}


def _grown(array: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    """`array` copied into a zeroed array of at least (rows, cols)."""
    shape = (rows,) if array.ndim == 1 else (rows, cols if cols is not None else array.shape[1])
    out = np.zeros(shape, dtype=array.dtype)
    out[tuple(slice(0, s) for s in array.shape)] = array
    return out


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        capacity = max(1, max_num_seqs)
        self.token_ids = np.zeros((capacity, max(1, max_model_len)), dtype=np.int32)
        self.block_table = np.zeros((capacity, max(1, -(-max_model_len // block_size))), dtype=np.int32)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_computed = np.zeros(capacity, dtype=np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest row
        # CUDA: pinned staging buffers (by name, grown on demand) and the event of their last copy.
        self._staged = device.type == "cuda"
        self._pin = self._staged and torch.cuda.is_available()
        self._staging: dict[str, torch.Tensor] = {}
        self._copies_done: torch.cuda.Event | None = None

    # ------------------------------------------------------------------ rows

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    @property
    def capacity(self) -> int:
        return self.token_ids.shape[0]

    def rows_for(self, req_ids: Sequence[str]) -> np.ndarray:
        row_of = self.row_of
        return np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def _grow_rows(self) -> None:
        old = self.capacity
        new = 2 * old
        self.token_ids = _grown(self.token_ids, new)
        self.block_table = _grown(self.block_table, new)
        self.num_tokens = _grown(self.num_tokens, new)
        self.num_computed = _grown(self.num_computed, new)
        self.num_blocks = _grown(self.num_blocks, new)
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _fit_tokens(self, n: int) -> None:
        """Room for `n` tokens per row (a request past max_model_len, e.g. one sampled token over)."""
        if n > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, self.capacity, max(n, 2 * self.token_ids.shape[1]))

    def _fit_blocks(self, n: int) -> None:
        if n > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, self.capacity, max(n, 2 * self.block_table.shape[1]))

    # ------------------------------------------------------------------ diffs

    def add_request(self, req_id: str, token_ids: Sequence[int], block_ids: Sequence[int], num_computed: int) -> int:
        """A request the runner has not seen: a free row gets its tokens, blocks and computed count."""
        if req_id in self.row_of:
            raise ValueError(f"add_request: request {req_id!r} already has a row")
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        n = len(token_ids)
        self._fit_tokens(n)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.update_blocks(req_id, block_ids)
        return row

    def remove_request(self, req_id: str) -> None:
        """Free the request's row (unknown ids are ignored: a request may finish before it ever ran)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.block_table[row, : self.num_blocks[row]] = 0  # a reused row starts zero-padded
        self.num_blocks[row] = 0
        self.num_tokens[row] = 0
        self.num_computed[row] = 0
        self._free_rows.append(row)

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        row = self.row_of[req_id]
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        self._fit_tokens(end)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def append_tokens_many(self, req_ids: Sequence[str], token_lists: Sequence[Sequence[int]]) -> None:
        """`append_tokens` for many requests in one vectorized scatter (each request at most once)."""
        if not req_ids:
            return
        rows = self.rows_for(req_ids)
        lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        ends = self.num_tokens[rows] + lens
        self._fit_tokens(int(ends.max()))
        total = int(lens.sum())
        if total:
            # Position of each new token: its row's old count + its index within the request's list.
            offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            positions = np.repeat(ends - lens, lens) + offsets
            self.token_ids[np.repeat(rows, lens), positions] = np.fromiter(
                chain.from_iterable(token_lists), dtype=np.int32, count=total)
        self.num_tokens[rows] = ends

    def update_blocks(self, req_id: str, block_ids: Sequence[int], replace: bool = False) -> None:
        """Append newly allocated blocks, or (`replace`, after a preemption) install a new table."""
        row = self.row_of[req_id]
        old = int(self.num_blocks[row])
        if replace:
            self.block_table[row, :old] = 0
            old = 0
        end = old + len(block_ids)
        self._fit_blocks(end)
        self.block_table[row, old:end] = block_ids
        self.num_blocks[row] = end

    def set_num_computed(self, req_ids: Sequence[str], num_computed: Iterable[int]) -> None:
        self.num_computed[self.rows_for(req_ids)] = np.fromiter(num_computed, dtype=np.int64, count=len(req_ids))

    def advance(self, rows: np.ndarray, query_lens: np.ndarray) -> None:
        """After a forward pass: the scheduled rows computed their queries."""
        self.num_computed[rows] += query_lens

    # ------------------------------------------------------------------ reading a row back

    def tokens_of(self, req_id: str) -> np.ndarray:
        row = self.row_of[req_id]
        return self.token_ids[row, : self.num_tokens[row]]

    def blocks_of(self, req_id: str) -> np.ndarray:
        row = self.row_of[req_id]
        return self.block_table[row, : self.num_blocks[row]]

    # ------------------------------------------------------------------ the step's inputs

    def prepare(
        self,
        req_ids: Sequence[str],
        query_lens: Sequence[int] | np.ndarray,
        drafts: Mapping[str, Sequence[int]] | None = None,
        rows: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Sequence i computes `query_lens[i]` tokens from its computed count on; its query is its own
        tokens from there, except for a request in `drafts`, whose query ends with those draft tokens
        (for a speculating decode: [last token] + drafts). Sequences must come decodes first. `rows`
        (the requests' rows, if the caller already has them) saves a lookup."""
        n = len(req_ids)
        if rows is None:
            rows = self.rows_for(req_ids)
        q = np.asarray(query_lens, dtype=np.int64)
        starts = self.num_computed[rows]
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        num_tokens = int(cu[-1])
        token_rows = np.repeat(rows, q)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], q)
        seq_lens = starts + q
        width = int(self.num_blocks[rows].max())
        cols = self.token_ids.shape[1]
        # Draft positions lie past the known tokens (maybe past the matrix): gather in range, overwrite below.
        ids = self.token_ids[token_rows, np.minimum(positions, cols - 1)].astype(np.int64)
        if drafts:
            batch_index = np.empty(self.capacity, dtype=np.int64)
            batch_index[rows] = np.arange(n)
            for rid, draft in drafts.items():
                if draft and rid in self.row_of:
                    end = int(cu[batch_index[self.row_of[rid]] + 1])
                    ids[end - len(draft) : end] = draft
        slots = self.block_table[token_rows, positions // self.block_size].astype(np.int64)
        slots *= self.block_size
        slots += positions % self.block_size
        table = self.block_table[rows, :width]

        if self._copies_done is not None:
            self._copies_done.synchronize()  # the last step's copies have read the staging buffers
        num_decodes = int(np.count_nonzero(q == 1))
        metadata = AttentionMetadata(
            slot_mapping=self._to_device("slot_mapping", slots),
            query_start_loc=self._to_device("query_start_loc", cu.astype(np.int32)),
            seq_lens=self._to_device("seq_lens", seq_lens.astype(np.int32)),
            block_tables=self._to_device("block_tables", table),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=int(q.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        input_ids = self._to_device("input_ids", ids)
        positions_t = self._to_device("positions", positions)
        if self._pin:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return input_ids, positions_t, metadata

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """On CPU: the step's own (fresh) array, wrapped without a copy. On CUDA: the array written into
        the named staging buffer (pinned where CUDA is available, grown on demand) and copied from it
        asynchronously."""
        if not self._staged:
            return torch.from_numpy(array)
        buf = self._staging.get(name)
        if buf is None or buf.numel() < array.size or buf.dtype != _TORCH_DTYPE[array.dtype.type]:
            size = max(array.size, 2 * buf.numel() if buf is not None else 256)
            buf = torch.empty(size, dtype=_TORCH_DTYPE[array.dtype.type], pin_memory=self._pin)
            self._staging[name] = buf
        host = buf[: array.size].view(array.shape)
        host.numpy()[...] = array
        return host.to(self.device, non_blocking=self._pin)
