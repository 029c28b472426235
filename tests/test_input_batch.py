"""The persistent input batch gives exactly the inputs of a from-scratch build over random schedules.

A schedule is a random sequence of the scheduler's diffs (requests added with or without a cached
prefix, finished, given sampled tokens and new blocks, preempted and resumed with a new block table)
and of steps (a random subset of the live requests in a random order, each a decode, a prefill chunk
or a speculating decode with draft tokens). At every step `InputBatch.prepare` must equal
`build_flat_inputs` over the same logical state: token ids, positions and every metadata field.
The batch starts tiny so that its rows, token columns and block columns all have to grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.engine.spec_decode.flat_batch import build_flat_inputs
from pagedserve.engine.worker.input_batch import InputBatch

BLOCK_SIZE = 4


@dataclass
class Req:
    tokens: list[int]
    blocks: list[int]
    computed: int
    drafts: list[int] = field(default_factory=list)


class Model:
    """The logical state (what the runner's Python lists used to hold) beside the persistent batch."""

    def __init__(self, device: torch.device | None = None, max_num_seqs: int = 2, max_model_len: int = 8):
        self.reqs: dict[str, Req] = {}
        self.device = device or torch.device("cpu")
        self.batch = InputBatch(max_num_seqs, max_model_len, BLOCK_SIZE, self.device)
        self.next_block = 1
        self.next_id = 0

    def new_blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def cover(self, rid: str, end: int) -> None:
        """Allocate blocks so that positions < end have slots (what the scheduler does before a step)."""
        req = self.reqs[rid]
        need = -(-end // BLOCK_SIZE) - len(req.blocks)
        if need > 0:
            blocks = self.new_blocks(need)
            req.blocks += blocks
            self.batch.update_blocks(rid, blocks)

    def check_rows(self) -> None:
        for rid, req in self.reqs.items():
            assert self.batch.tokens_of(rid).tolist() == req.tokens
            assert self.batch.blocks_of(rid).tolist() == req.blocks


def assert_same_inputs(got, want) -> None:
    (ids, pos, md), (ids_r, pos_r, md_r) = got, want
    for a, b in ((ids, ids_r), (pos, pos_r), (md.slot_mapping, md_r.slot_mapping),
                 (md.query_start_loc, md_r.query_start_loc), (md.seq_lens, md_r.seq_lens),
                 (md.block_tables, md_r.block_tables)):
        assert a.dtype == b.dtype and a.device.type == b.device.type
        assert torch.equal(a.cpu(), b.cpu()), (a, b)
    for name in ("num_decodes", "num_decode_tokens", "max_query_len", "max_seq_len", "query_start_loc_cpu",
                 "seq_lens_cpu"):
        assert getattr(md, name) == getattr(md_r, name), name


def step(model: Model, data: st.DataObject) -> None:
    live = list(model.reqs)
    if not live:
        return
    chosen = data.draw(st.permutations(live)).copy()[: data.draw(st.integers(1, len(live)))]
    chunks, starts, tables, query_lens, drafts = [], [], [], [], {}
    for rid in chosen:
        req = model.reqs[rid]
        kind = data.draw(st.sampled_from(["decode", "chunk", "spec"]))
        if kind == "chunk" and req.computed < len(req.tokens):
            start = req.computed
            q = data.draw(st.integers(1, len(req.tokens) - start))
            chunk = req.tokens[start : start + q]
        else:  # a decode: its last token (the scheduler rewinds computed to it), maybe with drafts
            start = len(req.tokens) - 1
            draft = data.draw(st.lists(st.integers(0, 999), max_size=3)) if kind == "spec" else []
            chunk = [req.tokens[-1], *draft]
            q = len(chunk)
            if draft:
                drafts[rid] = draft
            req.computed = start
            model.batch.set_num_computed([rid], [start])
        model.cover(rid, start + q)
        chunks.append(chunk)
        starts.append(start)
        query_lens.append(q)
    tables = [model.reqs[rid].blocks for rid in chosen]
    want = build_flat_inputs(chunks, starts, tables, BLOCK_SIZE, model.device)
    got = model.batch.prepare(chosen, query_lens, drafts)
    assert_same_inputs(got, want)
    # The forward pass computed the queries; drafts are not part of a request's tokens.
    rows = model.batch.rows_for(chosen)
    model.batch.advance(rows, np.asarray(query_lens))
    for rid, q in zip(chosen, query_lens):
        model.reqs[rid].computed += q


def apply_diff(model: Model, data: st.DataObject) -> None:
    live = list(model.reqs)
    op = data.draw(st.sampled_from(["add", "add", "finish", "append", "preempt"] if live else ["add"]))
    if op == "add":
        rid = f"r{model.next_id}"
        model.next_id += 1
        tokens = data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=30))
        computed = data.draw(st.integers(0, len(tokens) - 1))  # a prefix-cache hit or a PD-loaded prefix
        blocks = model.new_blocks(-(-max(computed, 1) // BLOCK_SIZE))
        model.reqs[rid] = Req(tokens, blocks, computed)
        model.batch.add_request(rid, tokens, blocks, computed)
        return
    rid = data.draw(st.sampled_from(live))
    if op == "finish":
        del model.reqs[rid]
        model.batch.remove_request(rid)
    elif op == "append":  # sampled tokens come back (several: accepted drafts)
        picked = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
        new = [data.draw(st.lists(st.integers(0, 999), max_size=3)) for _ in picked]
        for p, toks in zip(picked, new):
            model.reqs[p].tokens += toks
        if data.draw(st.booleans()):
            model.batch.append_tokens_many(picked, new)
        else:
            for p, toks in zip(picked, new):
                model.batch.append_tokens(p, toks)
    else:  # preempted (blocks freed) and resumed: recompute from 0 or from a cached prefix, new table
        req = model.reqs[rid]
        req.computed = data.draw(st.integers(0, len(req.tokens) - 1))
        req.blocks = model.new_blocks(data.draw(st.integers(0, 2)))
        model.batch.update_blocks(rid, req.blocks, replace=True)
        model.batch.set_num_computed([rid], [req.computed])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_prepare_matches_from_scratch_build(data):
    model = Model()
    for _ in range(data.draw(st.integers(1, 25))):
        if data.draw(st.booleans()):
            apply_diff(model, data)
        else:
            step(model, data)
        model.check_rows()
    step(model, data)
    assert len(model.batch) == len(model.reqs)


def test_rows_are_reused_and_arrays_grow():
    batch = InputBatch(2, 8, BLOCK_SIZE, torch.device("cpu"))
    rows = [batch.add_request(f"r{i}", [i] * 3, [i + 1], 0) for i in range(5)]
    assert rows == [0, 1, 2, 3, 4] and batch.capacity >= 5
    batch.remove_request("r1")
    batch.remove_request("unknown")  # a request that finished before it ever ran
    assert batch.add_request("r9", [7], [9], 0) == 1  # the freed row, its old blocks zeroed
    assert batch.blocks_of("r9").tolist() == [9] and batch.block_table[1, 1:].tolist() == [0] * 1
    batch.append_tokens("r9", list(range(20)))  # past max_model_len: the token columns grow
    batch.update_blocks("r9", list(range(10, 20)))
    assert batch.tokens_of("r9").tolist() == [7, *range(20)]
    assert batch.blocks_of("r9").tolist() == [9, *range(10, 20)]
    with pytest.raises(ValueError, match="already has a row"):
        batch.add_request("r9", [1], [1], 0)


def test_step_outputs_do_not_alias_the_next_step():
    """The tensors of one step stay intact while the next step is prepared (PP keeps batches in flight)."""
    model = Model()
    model.reqs["a"] = Req([1, 2, 3], [5], 2)
    model.batch.add_request("a", [1, 2, 3], [5], 2)
    ids, pos, md = model.batch.prepare(["a"], [1])
    model.batch.append_tokens("a", [4])
    model.batch.set_num_computed(["a"], [3])
    model.batch.prepare(["a"], [1])
    assert ids.tolist() == [3] and pos.tolist() == [2] and md.slot_mapping.tolist() == [5 * BLOCK_SIZE + 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned staging buffers, async copies)")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_prepare_matches_from_scratch_build_on_cuda(data):
    model = Model(torch.device("cuda"))
    for _ in range(data.draw(st.integers(1, 15))):
        if data.draw(st.booleans()):
            apply_diff(model, data)
        else:
            step(model, data)
    step(model, data)


def _metadata_fields(num_seqs: int = 2) -> dict:
    seq_lens = [3] * num_seqs
    return dict(
        slot_mapping=torch.arange(num_seqs, dtype=torch.int64),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32),
        num_decodes=num_seqs, num_decode_tokens=num_seqs, max_query_len=1, max_seq_len=3,
        query_start_loc_cpu=list(range(num_seqs + 1)), seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("field_name, value, match", [
    ("block_tables", torch.zeros((3, 1), dtype=torch.int32), "block_tables"),
    ("block_tables", torch.zeros(2, dtype=torch.int32), "block_tables"),
    ("seq_lens", torch.tensor([3, 3], dtype=torch.int64), "int32"),
    ("block_tables", torch.zeros((2, 1), dtype=torch.int64), "int32"),
    ("query_start_loc", torch.arange(2, dtype=torch.int32), "query_start_loc"),
    ("slot_mapping", torch.zeros((2, 1), dtype=torch.int64), "slot_mapping"),
    ("query_start_loc_cpu", [0, 1], "query_start_loc_cpu"),
    ("num_decodes", 3, "num_decodes"),
])
def test_attention_metadata_refuses_inconsistent_fields(field_name, value, match):
    """The attention layers call the unchecked kernels: the metadata checks itself once, when built."""
    AttentionMetadata(**_metadata_fields())  # consistent: accepted
    with pytest.raises(ValueError, match=match):
        AttentionMetadata(**{**_metadata_fields(), field_name: value})
