"""Persistent per-request sampling state for the vectorized sampler.

Every request the sampler has seen holds a slot: its parameters in host arrays (one row per slot)
and, in device tensors, what the batched processors read: logit_bias as a padded index/value row,
the ids min_tokens masks, an allowed_token_ids mask, and for requests with penalties the prompt's
seen-token mask and the output's token counts. All of it is built once, when the request is added;
after that a step only adds the output tokens sampled since the last step to the counts. A step's
`BatchView` gathers the rows of its batch (in batch order) and is reused while the batch keeps its
composition, so a steady decode batch costs no host work per row beyond a dict lookup (one view is
kept per purpose: the plain sampler's rows, and a speculating step's verified positions, where one
request holds several rows).

Requests are keyed by the identity of their `SamplingState` (request ids are not unique across
direct callers). A slot is freed by `release(state)` (the model runner calls it for finished
requests) or, failing that, when the state is garbage collected. A state's params, eos ids and bad
words are read once, when it is added; its output_token_ids may only grow.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.engine.failures import describe_failure

if TYPE_CHECKING:
    from pagedserve.engine.sample.state import SamplingState

# Host float columns, one row per slot.
F_TEMP, F_TOP_P, F_MIN_P, F_REP, F_FREQ, F_PRES = range(6)
# Host int columns: top_k (clamped to the vocabulary), logprobs (-1 = None), min_tokens, the row in
# the penalty / allowed pools (-1 = none), the number of logit_bias entries and of min_tokens ids.
I_TOP_K, I_LOGPROBS, I_MIN_TOKENS, I_PEN_ROW, I_ALLOWED_ROW, I_BIAS_LEN, I_STOP_LEN = range(7)
# Host flag columns.
B_GREEDY, B_SEEDED, B_PENALTY, B_BAD_WORDS, B_ERROR = range(5)


def check_ids(ids: list[int], vocab: int, field_name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{field_name}: token ids {bad} are outside the vocabulary (size {vocab})")


class _Rows:
    """A [capacity, width] device tensor that hands out rows from a free list and grows (x2) when full;
    its width grows too (new columns are `fill`). Row indices stay valid across growth."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, fill: float | int | bool = 0) -> None:
        self.fill = fill
        self.data = torch.full((4, max(width, 1)), fill, dtype=dtype, device=device)
        self._free: list[int] = []
        self._next = 0

    def alloc(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next == self.data.shape[0]:
            self._resize(2 * self.data.shape[0], self.data.shape[1])
        self._next += 1
        return self._next - 1

    def free(self, row: int) -> None:
        self._free.append(row)

    def ensure_rows(self, rows: int) -> None:
        """For a pool indexed by another allocator (slots, or a sibling pool's rows)."""
        if rows > self.data.shape[0]:
            self._resize(max(rows, 2 * self.data.shape[0]), self.data.shape[1])

    def ensure_width(self, width: int) -> None:
        if width > self.data.shape[1]:
            self._resize(self.data.shape[0], max(width, 2 * self.data.shape[1]))

    def _resize(self, rows: int, cols: int) -> None:
        new = torch.full((rows, cols), self.fill, dtype=self.data.dtype, device=self.data.device)
        new[: self.data.shape[0], : self.data.shape[1]] = self.data
        self.data = new


@dataclass(eq=False)
class _Entry:
    slot: int
    token: int  # tells a stale garbage-collection notice from the slot's current owner
    ref: weakref.ref
    counted: int = 0  # output tokens already in the penalty counts
    pen_row: int = -1  # its row in the penalty pools (-1: no penalties)
    error: str | None = None  # this request cannot be sampled (reported every step it is in a batch)


@dataclass(eq=False)
class BatchView:
    """One batch's rows, in batch order: host arrays and device tensors gathered once per composition."""

    entries: list[_Entry]
    device: torch.device
    f: np.ndarray  # [B, 6] float32 params
    i: np.ndarray  # [B, 7] int64 params
    b: np.ndarray  # [B, 5] flags
    greedy: np.ndarray  # [B] bool
    seeded: np.ndarray  # [B] bool: random rows with their own generator
    random_rows: np.ndarray  # batch rows that sample randomly
    greedy_rows: np.ndarray
    error_rows: list[int]
    pen_rows: list[int]  # rows with penalties (batch indices)
    min_rows: list[int]  # rows with min_tokens > 0 and ids to mask
    bad_rows: list[int]  # rows with bad words
    logprob_rows: np.ndarray
    plain_greedy: bool  # all greedy, no processor, no logprobs, no error: argmax of the raw logits
    needs_processing: bool
    states: list[SamplingState] = field(default_factory=list)  # this step's states (same objects each step)
    # Device tensors (None when the batch has no such rows).
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, [n, V] mask of disallowed tokens)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # flat (rows, token ids, values)
    # (rows, pool rows, rep, freq, pres ([n, 1] params), any repetition penalty, any frequency/presence one)
    penalties: tuple | None = None
    cache: dict[object, object] = field(default_factory=dict)  # per-composition derived tensors

    @property
    def num_rows(self) -> int:
        return len(self.entries)


def _on_dead(dead: list[tuple[int, int]], key: int, token: int, _ref: weakref.ref) -> None:
    dead.append((key, token))


class SamplingBatch:
    """The sampler's persistent rows for one vocabulary size and device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        cap = 16
        self._f = np.zeros((cap, 6), dtype=np.float32)
        self._i = np.zeros((cap, 7), dtype=np.int64)
        self._b = np.zeros((cap, 5), dtype=bool)
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._by_id: dict[int, _Entry] = {}  # id(state) -> entry; only live states (see _drain)
        self._dead: list[tuple[int, int]] = []  # (id, token) of states garbage collected while held
        self._tokens = 0
        self._generation = 0  # bumped when a held row's flags change (a cached view is then stale)
        # Per purpose (the caller's key): the last view built and the generation it was built at.
        self._views: dict[str, tuple[BatchView, int]] = {}
        dev, v = self.device, vocab_size
        self._bias_idx = _Rows(1, torch.long, dev, 0)
        self._bias_val = _Rows(1, torch.float32, dev, 0.0)
        self._stop_idx = _Rows(1, torch.long, dev, 0)
        self._allowed = _Rows(v, torch.bool, dev, False)
        self._seen = _Rows(v, torch.bool, dev, False)  # prompt tokens of penalized requests
        self._counts = _Rows(v, torch.float32, dev, 0.0)  # output token counts of penalized requests

    def __len__(self) -> int:
        return len(self._by_id)

    # ------------------------------------------------------------------ adding and releasing rows

    def release(self, state: SamplingState) -> None:
        """Free the slot of a finished request (a no-op for a state the batch does not hold)."""
        entry = self._by_id.pop(id(state), None)
        if entry is not None and entry.ref() is state:
            self._free_entry(entry)
        elif entry is not None:  # not this state's entry: put it back
            self._by_id[id(state)] = entry

    def _drain(self) -> None:
        while self._dead:
            key, token = self._dead.pop()
            entry = self._by_id.get(key)
            if entry is not None and entry.token == token:
                del self._by_id[key]
                self._free_entry(entry)

    def _free_entry(self, entry: _Entry) -> None:
        slot = entry.slot
        for col, pool in ((I_PEN_ROW, self._counts), (I_ALLOWED_ROW, self._allowed)):
            row = int(self._i[slot, col])
            if row >= 0:
                pool.free(row)
        self._i[slot, I_PEN_ROW] = self._i[slot, I_ALLOWED_ROW] = -1
        entry.ref = None  # its weakref (and callback) die with it: no notice for a released slot
        self._free_slots.append(slot)
        self._generation += 1

    def _alloc_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        if self._next_slot == self._f.shape[0]:
            cap = 2 * self._f.shape[0]
            self._f = np.resize(self._f, (cap, 6))
            self._i = np.resize(self._i, (cap, 7))
            self._b = np.resize(self._b, (cap, 5))
        self._next_slot += 1
        return self._next_slot - 1

    def _add(self, state: SamplingState) -> _Entry:
        slot = self._alloc_slot()
        self._tokens += 1
        key = id(state)
        ref = weakref.ref(state, functools.partial(_on_dead, self._dead, key, self._tokens))
        entry = _Entry(slot=slot, token=self._tokens, ref=ref)
        self._by_id[key] = entry
        self._generation += 1
        p, vocab = state.params, self.vocab_size
        greedy = p.greedy
        penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self._f[slot] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        ints = self._i[slot]
        ints[:] = (min(p.top_k, vocab), -1 if p.logprobs is None else p.logprobs, p.min_tokens, -1, -1, 0, 0)
        flags = self._b[slot]
        flags[:] = False
        flags[B_GREEDY] = greedy
        flags[B_SEEDED] = p.seed is not None and not greedy
        flags[B_PENALTY] = penalized
        flags[B_BAD_WORDS] = bool(state.bad_words_token_ids)
        try:
            self._add_tensors(state, entry, penalized)
        except Exception as exc:  # bad ids: this request alone fails, whenever it is sampled
            entry.error = describe_failure(exc)
            flags[B_ERROR] = True
        return entry

    def _add_tensors(self, state: SamplingState, entry: _Entry, penalized: bool) -> None:
        """The device rows of a new request (checked in the order the per-row processors run)."""
        p, vocab, dev, slot = state.params, self.vocab_size, self.device, entry.slot
        ints = self._i[slot]
        if p.allowed_token_ids is not None:
            check_ids(p.allowed_token_ids, vocab, "allowed_token_ids")
        if p.logit_bias:
            check_ids(list(p.logit_bias), vocab, "logit_bias")
        if p.allowed_token_ids is not None:
            row = self._allowed.alloc()
            ints[I_ALLOWED_ROW] = row
            self._allowed.data[row] = False
            self._allowed.data[row, torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = True
        if p.logit_bias:
            n = len(p.logit_bias)
            for pool in (self._bias_idx, self._bias_val):
                pool.ensure_width(n)
                pool.ensure_rows(slot + 1)
            self._bias_idx.data[slot, :n] = torch.tensor(list(p.logit_bias), dtype=torch.long)
            self._bias_val.data[slot, :n] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            ints[I_BIAS_LEN] = n
        if p.min_tokens > 0:
            banned = sorted(t for t in set(p.stop_token_ids) | set(state.eos_token_ids) if 0 <= t < vocab)
            if banned:
                self._stop_idx.ensure_width(len(banned))
                self._stop_idx.ensure_rows(slot + 1)
                self._stop_idx.data[slot, : len(banned)] = torch.tensor(banned, dtype=torch.long)
                ints[I_STOP_LEN] = len(banned)
        if penalized:
            check_ids_fast(state.prompt_token_ids, vocab, "prompt_token_ids")
            row = self._counts.alloc()  # the seen mask shares the counts pool's rows
            self._seen.ensure_rows(row + 1)
            ints[I_PEN_ROW] = entry.pen_row = row
            self._seen.data[row] = False
            self._counts.data[row] = 0.0
            if state.prompt_token_ids:
                self._seen.data[row, torch.tensor(state.prompt_token_ids, dtype=torch.long, device=dev)] = True

    # ------------------------------------------------------------------ one step's view

    def prepare(self, states: list[SamplingState], key: str = "sample") -> BatchView:
        """The view of this step's batch (adding new states), with penalty counts brought up to date.
        A state may fill several rows (a speculating request's positions). `key` names the purpose
        whose last view is reused while the batch keeps its composition."""
        self._drain()
        by_id = self._by_id
        entries = [by_id.get(id(s)) or self._add(s) for s in states]
        view, generation = self._views.get(key, (None, -1))
        if view is None or generation != self._generation or view.entries != entries:
            view = self._build_view(entries, key)
        view.states = states
        if view.pen_rows and self._sync_counts(view):
            view = self._build_view(entries, key)  # a row failed while counting: its flags changed
            view.states = states
        return view

    def _sync_counts(self, view: BatchView) -> bool:
        """Add the output tokens sampled since the last step to the counts; True if a row failed."""
        rows: list[int] = []
        tokens: list[int] = []
        failed = False
        vocab, entries, states = self.vocab_size, view.entries, view.states
        for r in view.pen_rows:
            entry = entries[r]
            output = states[r].output_token_ids
            n, counted = len(output), entry.counted
            if n == counted or entry.error is not None:
                continue  # (also every row after a request's first: one request may fill several)
            if n == counted + 1 and 0 <= output[counted] < vocab:  # one new token: the usual step
                rows.append(entry.pen_row)
                tokens.append(output[counted])
                entry.counted = n
                continue
            if n < counted:  # the output was replaced: count it again
                self._counts.data[entry.pen_row] = 0.0
                counted = 0
            new = output[counted:]
            entry.counted = n
            if min(new) < 0 or max(new) >= vocab:
                entry.error = describe_failure(ValueError(
                    f"output_token_ids: token ids {[t for t in new if not 0 <= t < vocab]} "
                    f"are outside the vocabulary (size {vocab})"
                ))
                self._b[entry.slot, B_ERROR] = True
                self._generation += 1
                failed = True
                continue
            rows.extend([entry.pen_row] * len(new))
            tokens.extend(new)
        if tokens:
            index = torch.tensor([rows, tokens], dtype=torch.long).to(self.device, non_blocking=True)
            counts = self._counts.data
            counts.index_put_((index[0], index[1]), torch.ones((), device=self.device), accumulate=True)
        return failed

    def _build_view(self, entries: list[_Entry], key: str) -> BatchView:
        slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
        f, i, b = self._f[slots], self._i[slots], self._b[slots]
        greedy = b[:, B_GREEDY].copy()
        error_rows = np.flatnonzero(b[:, B_ERROR]).tolist()
        pen_rows = np.flatnonzero(b[:, B_PENALTY] & ~b[:, B_ERROR])
        min_rows = np.flatnonzero((i[:, I_MIN_TOKENS] > 0) & (i[:, I_STOP_LEN] > 0) & ~b[:, B_ERROR])
        bad_rows = np.flatnonzero(b[:, B_BAD_WORDS] & ~b[:, B_ERROR])
        allowed_rows = np.flatnonzero(i[:, I_ALLOWED_ROW] >= 0)
        bias_rows = np.flatnonzero(i[:, I_BIAS_LEN] > 0)
        logprob_rows = np.flatnonzero(i[:, I_LOGPROBS] >= 0)
        needs = bool(len(pen_rows) or len(min_rows) or len(bad_rows) or len(allowed_rows) or len(bias_rows))
        view = BatchView(
            entries=entries, device=self.device, f=f, i=i, b=b, greedy=greedy, seeded=b[:, B_SEEDED].copy(),
            random_rows=np.flatnonzero(~greedy), greedy_rows=np.flatnonzero(greedy), error_rows=error_rows,
            pen_rows=pen_rows.tolist(),
            min_rows=min_rows.tolist(), bad_rows=bad_rows.tolist(), logprob_rows=logprob_rows,
            plain_greedy=bool(greedy.all()) and not needs and not len(logprob_rows) and not error_rows,
            needs_processing=needs,
        )
        dev = self.device
        if len(allowed_rows):
            mask = ~self._allowed.data[_to(i[allowed_rows, I_ALLOWED_ROW], dev)]
            view.allowed = (_to(allowed_rows, dev), mask)
        if len(bias_rows):
            lens = i[bias_rows, I_BIAS_LEN]
            width = int(lens.max())
            valid = torch.from_numpy(np.arange(width)[None, :] < lens[:, None]).to(dev)
            slot_idx = _to(slots[bias_rows], dev)
            idx = self._bias_idx.data[slot_idx, :width][valid]
            val = self._bias_val.data[slot_idx, :width][valid]
            view.bias = (_to(np.repeat(bias_rows, lens), dev), idx, val)
        if len(pen_rows):
            params = torch.from_numpy(f[pen_rows][:, [F_REP, F_FREQ, F_PRES]].T.copy()).to(dev)
            rep, freq, pres = (p.unsqueeze(1) for p in params)
            pf = f[pen_rows]
            use_rep = bool((pf[:, F_REP] != 1.0).any())
            use_openai = bool((pf[:, F_FREQ] != 0.0).any() or (pf[:, F_PRES] != 0.0).any())
            pool_rows = _to(i[pen_rows, I_PEN_ROW], dev)
            view.penalties = (_to(pen_rows, dev), pool_rows, rep, freq, pres, use_rep, use_openai)
        self._views[key] = (view, self._generation)
        return view

    def stop_ids(self, view: BatchView, rows: list[int]) -> torch.Tensor:
        """[len(rows), width] ids that min_tokens masks for these batch rows, a short row padded with
        its own first id (masking it twice is harmless)."""
        lens = view.i[rows, I_STOP_LEN]
        width = int(lens.max())
        slots = _to(np.fromiter((view.entries[r].slot for r in rows), dtype=np.int64, count=len(rows)), self.device)
        ids = self._stop_idx.data[slots, :width]
        if int(lens.min()) == width:
            return ids
        valid = torch.from_numpy(np.arange(width)[None, :] < lens[:, None]).to(self.device)
        return torch.where(valid, ids, ids[:, :1])

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt seen mask, output counts) of the penalty pool, indexed by the view's pool rows."""
        return self._seen.data, self._counts.data


def check_ids_fast(ids: list[int], vocab: int, field_name: str) -> None:
    """check_ids for long lists: one min/max pass unless something is out of range."""
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        check_ids(ids, vocab, field_name)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device, non_blocking=True)
