"""Model parity: our paged forward vs HF transformers logits on the same tiny random checkpoints.

Each case saves a tiny HF model with save_pretrained(safe_serialization=True),
loads it with `load_model`, and runs three steps through the paged KV cache
(shuffled block ids): a mixed prefill step, a step with a decode + a prefill
chunk on a cached prefix + a prefix-cache hit sharing another sequence's blocks,
and an all-decode step. Every computed token's logits must match HF's logits at
that position in float32.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.engine.models.loader import load_model, resolve_dtype
from pagedserve.engine.models import get_model_class
from pagedserve.parallel.state import ParallelContext

BLOCK_SIZE = 4
NUM_BLOCKS = 48
ATOL = 1e-4

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)


@dataclass
class PagedBatcher:
    """A tiny stand-in for the scheduler + block manager: block tables, slot mapping, metadata."""

    block_size: int = BLOCK_SIZE
    num_blocks: int = NUM_BLOCKS
    seed: int = 0
    free: list[int] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(1, self.num_blocks))  # block 0 stays unused: padding in block tables
        random.Random(self.seed).shuffle(self.free)

    def add(self, seq: str, shared_prefix_of: str | None = None, num_shared_blocks: int = 0) -> None:
        """Register a sequence; optionally reuse another sequence's first full blocks (prefix hit)."""
        self.tables[seq] = list(self.tables[shared_prefix_of][:num_shared_blocks]) if shared_prefix_of else []
        self.computed[seq] = num_shared_blocks * self.block_size

    def step(self, chunks: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Schedule ``chunks`` (decodes, i.e. 1-token chunks, first) -> input_ids, positions, metadata."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for seq, tokens in chunks:
            start = self.computed[seq]
            end = start + len(tokens)
            table = self.tables[seq]
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for p in range(start, end):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += tokens
            pos += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.computed[seq] = end
        num_decodes = 0
        while num_decodes < len(chunks) and len(chunks[num_decodes][1]) == 1:
            num_decodes += 1
        width = max(len(self.tables[s]) for s, _ in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in chunks]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), md


def make_kv_caches(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    num_layers, kv_heads, head_size = model.kv_cache_shape_per_layer()
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size)
    # Random garbage (like uninitialised memory): a read of a slot that was never written breaks parity.
    g = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(shape, generator=g).to(dtype) * 3, torch.randn(shape, generator=g).to(dtype) * 3)
        for _ in range(num_layers)
    ]


def sequences(vocab_size: int, seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, vocab_size, (15,), generator=g).tolist()
    b = torch.randint(0, vocab_size, (9,), generator=g).tolist()
    c = a[:8] + torch.randint(0, vocab_size, (6,), generator=g).tolist()  # shares A's first two blocks
    return {"A": a, "B": b, "C": c}


def schedule() -> list[list[tuple[str, int, int]]]:
    """Steps as (seq, start, end) token ranges; 1-token chunks (decodes) first within a step."""
    return [
        [("A", 0, 13), ("B", 0, 5)],  # prefill A, first chunk of B
        [("A", 13, 14), ("B", 5, 8), ("C", 8, 13)],  # decode A, B's chunk on its cached prefix, C hits A's prefix
        [("A", 14, 15), ("B", 8, 9), ("C", 13, 14)],  # all decodes
    ]


def run_paged(model, parallel_forward=None) -> dict[str, dict[int, torch.Tensor]]:
    """Run `schedule()` through the model; returns seq -> position -> logits.

    ``parallel_forward(input_ids, positions, kv_caches, md)`` replaces the plain
    forward + compute_logits (e.g. a pipeline stage); it returns None on stages without logits.
    """
    seqs = sequences(model.spec.vocab_size)
    batcher = PagedBatcher()
    batcher.add("A")
    batcher.add("B")
    kv_caches = make_kv_caches(model)
    out: dict[str, dict[int, torch.Tensor]] = {s: {} for s in seqs}
    for step in schedule():
        if any(s == "C" for s, _, _ in step) and "C" not in batcher.tables:
            batcher.add("C", shared_prefix_of="A", num_shared_blocks=2)
        input_ids, positions, md = batcher.step([(s, seqs[s][a:b]) for s, a, b in step])
        with torch.no_grad():
            if parallel_forward is None:
                hidden = model(input_ids, positions, kv_caches, md)
                logits = model.compute_logits(hidden)
            else:
                logits = parallel_forward(input_ids, positions, kv_caches, md)
        if logits is None:  # a pipeline stage other than the last: nothing to record
            continue
        row = 0
        for s, a, b in step:
            for p in range(a, b):
                out[s][p] = logits[row]
                row += 1
    return out


def hf_logits(hf_model, vocab_size: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {s: hf_model(torch.tensor([t])).logits[0].float() for s, t in sequences(vocab_size).items()}


def build_checkpoint(config_cls, tmp_path: Path, max_shard_size: str | None = None, **overrides):
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    hf_model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    return transformers.AutoConfig.from_pretrained(tmp_path), hf_model


def assert_parity(ours: dict[str, dict[int, torch.Tensor]], ref: dict[str, torch.Tensor]) -> None:
    for s, by_pos in ours.items():
        for p, logits in by_pos.items():
            assert logits.dtype == torch.float32
            assert torch.isfinite(logits).all(), f"{s}@{p}: non-finite logits"
            torch.testing.assert_close(logits, ref[s][p], atol=ATOL, rtol=1e-4, msg=lambda m: f"{s}@{p}: {m}")
    # every scheduled token was compared (C's first 8 tokens are a prefix-cache hit, never computed)
    assert sum(len(v) for v in ours.values()) == sum(b - a for step in schedule() for _, a, b in step) == 30


CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama_tied_bias": (transformers.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama3_rope_sharded": (
        transformers.LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
            _max_shard_size="40KB",
        ),
    ),
    "mistral_sliding": (transformers.MistralConfig, dict(sliding_window=6)),
    "qwen2_bias": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2_sliding_layer": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen3_qknorm_headdim": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_hf(case: str, tmp_path: Path) -> None:
    config_cls, overrides = CASES[case]
    overrides = dict(overrides)
    shard = overrides.pop("_max_shard_size", None)
    hf_config, hf_model = build_checkpoint(config_cls, tmp_path, shard, **overrides)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert_parity(run_paged(model), hf_logits(hf_model, hf_config.vocab_size))


def test_qwen3_head_dim_and_kv_shape(tmp_path: Path) -> None:
    hf_config, _ = build_checkpoint(transformers.Qwen3Config, tmp_path, head_dim=32)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    assert model.kv_cache_shape_per_layer() == (2, 2, 32)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)


def test_llama3_rope_scaling_changes_logits(tmp_path: Path) -> None:
    """Guard against the scaling being silently dropped: the same weights without it must differ."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path, rope_parameters=rope)
    scaled = run_paged(load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single()))
    hf_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = run_paged(load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single()))
    assert not torch.allclose(scaled["A"][12], plain["A"][12], atol=1e-3)


def test_unsupported_architecture_lists_supported() -> None:
    config = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as e:
        get_model_class(config)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_missing_and_unexpected_weights(tmp_path: Path) -> None:
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}, path)
    with pytest.raises(ValueError, match="down_proj"):
        load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    save_file({**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.extra.weight'"):
        load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())


def test_no_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path), transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **COMMON), torch.float32, ParallelContext.single())


def test_resolve_dtype(monkeypatch) -> None:
    from pagedserve.engine import device_limits

    monkeypatch.setattr(device_limits, "cpu_capabilities", lambda: {})  # no native bf16: fp32 stays fp32
    cfg = transformers.LlamaConfig(**COMMON)
    cfg.dtype = torch.bfloat16
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    cfg.dtype = "float16"
    assert resolve_dtype("auto", cfg) == torch.float16
    cfg.dtype = None
    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("half", cfg) == torch.float16
    assert resolve_dtype("float", cfg) == torch.float32
    assert resolve_dtype("bfloat16", cfg) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cfg)


def test_bfloat16_load_casts_parameters(tmp_path: Path) -> None:
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path)
    model = load_model(str(tmp_path), hf_config, torch.bfloat16, ParallelContext.single())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    logits = run_paged_bf16(model)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def run_paged_bf16(model) -> torch.Tensor:
    batcher = PagedBatcher()
    batcher.add("A")
    input_ids, positions, md = batcher.step([("A", list(range(10)))])
    with torch.no_grad():
        hidden = model(input_ids, positions, make_kv_caches(model, torch.bfloat16), md)
    return model.compute_logits(hidden)


class CopyInHooks:
    """A KV connector stand-in: at wait_for_layer_load it copies a 'remote' layer cache into ours."""

    def __init__(self, remote: list[tuple[torch.Tensor, torch.Tensor]], local: list[tuple[torch.Tensor, torch.Tensor]]):
        self.remote, self.local = remote, local
        self.calls: list[tuple[str, int]] = []

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.calls.append(("wait", layer_idx))
        for dst, src in zip(self.local[layer_idx], self.remote[layer_idx]):
            dst.copy_(src)


def test_kv_hooks_load_before_attention(tmp_path: Path) -> None:
    """Prefix KV computed elsewhere and loaded layer by layer through kv_hooks gives HF's logits."""
    hf_config, hf_model = build_checkpoint(transformers.LlamaConfig, tmp_path)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    tokens = sequences(hf_config.vocab_size)["A"]
    batcher = PagedBatcher()
    batcher.add("A")
    remote = make_kv_caches(model)
    with torch.no_grad():
        ids, pos, md = batcher.step([("A", tokens[:8])])
        model(ids, pos, remote, md)  # the "prefill instance"
        local = [(k.clone().normal_(), v.clone().normal_()) for k, v in remote]  # fresh cache, garbage
        hooks = CopyInHooks(remote, local)
        ids, pos, md = batcher.step([("A", tokens[8:13])])
        logits = model.compute_logits(model(ids, pos, local, md, kv_hooks=hooks))
    assert hooks.calls == [("wait", 0), ("wait", 1)]
    ref = hf_logits(hf_model, hf_config.vocab_size)["A"][8:13]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)
