"""Tensor/pipeline-parallel layers on CPU with gloo: each parallel layer vs its dense twin,
per-rank shard shapes and reads, PP send/recv, and TP=2 / PP=2 / TP2xPP2 model logits vs TP=1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import transformers

from pagedserve.engine.models.loader import load_model
from pagedserve.parallel.communication import pp_recv_tensors, pp_send_tensors, tp_all_gather, tp_all_reduce
from pagedserve.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.parallel.pipeline import IntermediateTensors, layer_range
from pagedserve.parallel.state import ParallelContext, destroy_distributed, init_distributed
from tests.test_models_parity import COMMON, assert_parity, run_paged

IN, OUT = 16, 24


class RecordingSlice:
    """A lazy checkpoint handle (like safetensors get_slice) that counts the elements actually read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.elements_read = 0

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self.tensor[index].clone()
        self.elements_read += out.numel()
        return out


def _spawn(tmp_path: Path, world: int, tp: int, pp: int, body: Callable, *args: Any) -> None:
    torch.multiprocessing.start_processes(
        _worker,
        args=(world, tp, pp, f"file://{tmp_path}/dist_init", body, args),
        nprocs=world,
        join=True,
        start_method="spawn",
    )


def _worker(rank: int, world: int, tp: int, pp: int, init_method: str, body: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(rank, world, tp, pp, init_method, backend="gloo", timeout_s=60)
    try:
        body(ctx, *args)
    finally:
        destroy_distributed()


# ---- layer-level checks (TP=2) --------------------------------------------------------------


def _layers_body(ctx: ParallelContext) -> None:
    assert (ctx.tp_size, ctx.pp_size, ctx.tp_rank) == (2, 1, ctx.rank)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, IN, generator=g)
    w, b = torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)

    col = ColumnParallelLinear(IN, OUT, ctx, torch.float32, bias=True, gather_output=True)
    handle = RecordingSlice(w)
    col.weight_loader(col.weight, handle)
    col.bias.weight_loader(col.bias, b)
    assert col.weight.shape == (OUT // 2, IN) and handle.elements_read == OUT // 2 * IN
    torch.testing.assert_close(col(x), F.linear(x, w, b))

    row = RowParallelLinear(OUT, IN, ctx, torch.float32, bias=True)
    w2, b2 = torch.randn(IN, OUT, generator=g), torch.randn(IN, generator=g)
    handle = RecordingSlice(w2)
    row.weight_loader(row.weight, handle)
    row.bias.weight_loader(row.bias, b2)
    assert row.weight.shape == (IN, OUT // 2) and handle.elements_read == IN * OUT // 2
    y = torch.randn(5, OUT, generator=g)
    shard = y[:, ctx.tp_rank * OUT // 2 : (ctx.tp_rank + 1) * OUT // 2]
    torch.testing.assert_close(row(shard), F.linear(y, w2, b2))  # bias added exactly once

    gate, up = torch.randn(OUT, IN, generator=g), torch.randn(OUT, IN, generator=g)
    merged = MergedColumnParallelLinear(IN, [OUT, OUT], ctx, torch.float32)
    merged.weight_loader(merged.weight, RecordingSlice(gate), 0)
    merged.weight_loader(merged.weight, RecordingSlice(up), 1)
    assert merged.weight.shape == (OUT, IN)
    gathered = tp_all_gather(merged(x).view(5, 2, OUT // 2), ctx, dim=-1)  # [5, 2, OUT]: (gate, up)
    torch.testing.assert_close(gathered[:, 0], F.linear(x, gate))
    torch.testing.assert_close(gathered[:, 1], F.linear(x, up))

    for num_kv_heads in (2, 1):  # split KV heads / replicated KV head (tp > num_kv_heads)
        heads, hs = 4, 4
        wq = torch.randn(heads * hs, IN, generator=g)
        wk, wv = (torch.randn(num_kv_heads * hs, IN, generator=g) for _ in range(2))
        bq = torch.randn(heads * hs, generator=g)
        bk, bv = (torch.randn(num_kv_heads * hs, generator=g) for _ in range(2))
        qkv = QKVParallelLinear(IN, hs, heads, num_kv_heads, ctx, torch.float32, bias=True)
        for sid, wt, bt in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            qkv.weight_loader(qkv.weight, RecordingSlice(wt), sid)
            qkv.bias.weight_loader(qkv.bias, bt, sid)
        kv_local = max(num_kv_heads // 2, 1)
        assert qkv.weight.shape == ((heads // 2 + 2 * kv_local) * hs, IN)
        q, k, v = qkv.split(qkv(x))
        q_ref = F.linear(x, wq, bq)[:, ctx.tp_rank * 2 * hs : (ctx.tp_rank + 1) * 2 * hs]
        kv_head = ctx.tp_rank if num_kv_heads == 2 else 0
        k_ref = F.linear(x, wk, bk)[:, kv_head * hs : (kv_head + kv_local) * hs]
        v_ref = F.linear(x, wv, bv)[:, kv_head * hs : (kv_head + kv_local) * hs]
        torch.testing.assert_close(q, q_ref)
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)

    vocab = 11  # not divisible by tp: the last shard is padded
    table = torch.randn(vocab, IN, generator=g)
    emb = VocabParallelEmbedding(vocab, IN, ctx, torch.float32)
    handle = RecordingSlice(table)
    emb.weight_loader(emb.weight, handle)
    assert emb.weight.shape == (6, IN) and handle.elements_read == (6 if ctx.tp_rank == 0 else 5) * IN
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    torch.testing.assert_close(emb(ids), F.embedding(ids, table))

    head = ParallelLMHead(vocab, IN, ctx, torch.float32)
    head.weight_loader(head.weight, table)
    logits = head.compute_logits(x)
    assert logits.shape == (5, vocab)
    torch.testing.assert_close(logits, F.linear(x, table))

    t = torch.full((3,), float(ctx.tp_rank + 1))
    torch.testing.assert_close(tp_all_reduce(t, ctx), torch.full((3,), 3.0))


def test_tp2_layers_match_dense(tmp_path: Path) -> None:
    _spawn(tmp_path, 2, 2, 1, _layers_body)


# ---- PP plumbing --------------------------------------------------------------------------


def test_layer_range_is_contiguous_and_balanced() -> None:
    for n in range(1, 9):
        for pp in range(1, n + 1):
            ranges = [layer_range(n, r, pp) for r in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(pp - 1))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="num_layers"):
        layer_range(2, 0, 3)
    with pytest.raises(ValueError, match="pp_rank"):
        layer_range(4, 2, 2)


def test_init_distributed_validates_layout() -> None:
    with pytest.raises(ValueError, match="world_size"):
        init_distributed(0, 3, 2, 1, "file:///nonexistent")
    with pytest.raises(ValueError, match="rank"):
        init_distributed(4, 4, 2, 2, "file:///nonexistent")


def test_single_context_collectives_are_noops() -> None:
    ctx = ParallelContext.single()
    x = torch.randn(3, 4)
    assert tp_all_reduce(x, ctx) is x and tp_all_gather(x, ctx) is x
    assert ctx.is_first_pp_stage and ctx.is_last_pp_stage


# ---- model forwards: TP=2, PP=2, TP2xPP2 vs TP=1 ----------------------------------------------


def _stage_forward(model, ctx: ParallelContext):
    """One pipeline step as a driver would run it: recv, forward, send (or compute logits on the last stage)."""

    def forward(input_ids, positions, kv_caches, md):
        intermediate = None
        if not ctx.is_first_pp_stage:
            intermediate = IntermediateTensors.from_dict(pp_recv_tensors(ctx))
        out = model(input_ids if ctx.is_first_pp_stage else None, positions, kv_caches, md, intermediate)
        if not ctx.is_last_pp_stage:
            assert isinstance(out, IntermediateTensors)
            pp_send_tensors(out.to_dict(), ctx)
            return None
        return model.compute_logits(out)

    return forward


def _model_body(ctx: ParallelContext, model_dir: str, num_layers: int) -> None:
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    reference = run_paged(load_model(model_dir, hf_config, torch.float32, ParallelContext.single()))
    model = load_model(model_dir, hf_config, torch.float32, ctx)
    start, end = layer_range(num_layers, ctx.pp_rank, ctx.pp_size)
    assert (model.start_layer, model.end_layer) == (start, end) and len(model.model.layers) == end - start
    spec = model.spec
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape[0] == (
        spec.num_heads // ctx.tp_size + 2 * max(spec.num_kv_heads // ctx.tp_size, 1)
    ) * spec.head_size
    assert model.model.layers[0].mlp.down_proj.weight.shape == (spec.hidden_size, spec.intermediate_size // ctx.tp_size)
    assert (model.model.embed_tokens is not None) == ctx.is_first_pp_stage
    assert (model.lm_head is not None) == ctx.is_last_pp_stage
    ours = run_paged(model, _stage_forward(model, ctx))
    if ctx.is_last_pp_stage:
        assert_parity(ours, reference)  # reference[seq][pos] indexes like HF's [seq][pos] logits
    else:
        assert all(not v for v in ours.values())


def _checkpoint(tmp_path: Path, config_cls, **overrides) -> str:
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path / "ckpt"
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def test_tp2_model_matches_tp1(tmp_path: Path) -> None:
    # Qwen2: qkv bias sharded; one KV head replicated on both ranks; tied, odd vocab (padded shard).
    ckpt = _checkpoint(tmp_path, transformers.Qwen2Config, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=301)
    _spawn(tmp_path, 2, 2, 1, _model_body, ckpt, COMMON["num_hidden_layers"])


def test_pp2_model_matches_pp1(tmp_path: Path) -> None:
    # Tied embeddings across stages: the last stage loads the embedding into its own LM head.
    ckpt = _checkpoint(tmp_path, transformers.LlamaConfig, num_hidden_layers=3, tie_word_embeddings=True)
    _spawn(tmp_path, 2, 1, 2, _model_body, ckpt, 3)


def test_tp2_pp2_model_matches_tp1(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, transformers.Qwen3Config, head_dim=32, tie_word_embeddings=False)
    _spawn(tmp_path, 4, 2, 2, _model_body, ckpt, COMMON["num_hidden_layers"])
