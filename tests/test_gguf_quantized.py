"""GGUF weights executed quantized (quantization="gguf"): the layers keep the file's blocks, and the
model computes what HF computes on the same weights dequantized, in float32.

Files of every supported quant type are written by the tests (tests/test_gguf_loader.py) from tiny
random weights; HF transformers loads the same file with ``gguf_file=`` (dequantized) as the oracle.
The quantized matmul sums in another order than HF's dense one, so logits agree to float32 rounding;
greedy outputs must be equal token for token except after a near-tie: where they diverge, HF's
logits for the two tokens must lie within `NEAR_TIE` of each other (and the rest is not compared).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.config import EngineConfig  # noqa: E402
from pagedserve.engine.models.gguf_loader import QUANTIZED_TYPES  # noqa: E402
from pagedserve.engine.models.loader import load_model  # noqa: E402
from pagedserve.parallel.state import ParallelContext  # noqa: E402
from tests.test_engine_parity import assert_all_blocks_free  # noqa: E402
from tests.test_gguf_loader import (  # noqa: E402
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    VOCAB,
    assert_same_params,
    finish,
    gguf_name,
    hf_weights,
    new_writer,
    write_gguf,
)
from tests.test_models_parity import assert_parity, run_paged  # noqa: E402

NEAR_TIE = 1e-4
MAX_NEW = 8
# Types with 32-element blocks, which the gguf package writes and the tiny 64-wide model holds; the
# K-quants (256-element super-blocks) get a wider model of their own below.
BLOCK_32_TYPES = [q for q in QUANTIZED_TYPES if not q.endswith("_K")]


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_paged_reference(hf, vocab: int) -> dict[str, torch.Tensor]:
    from tests.test_models_parity import sequences

    with torch.no_grad():
        return {s: hf(torch.tensor([t])).logits[0].float() for s, t in sequences(vocab).items()}


def linears(model) -> dict[str, torch.nn.Module]:
    layer = model.model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "embed": model.model.embed_tokens, "lm_head": model.lm_head}


@pytest.mark.parametrize("qtype", BLOCK_32_TYPES)
@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_quantized_model_keeps_blocks_and_matches_hf_logits(tmp_path, qtype, arch, tied):
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, hf_weights(arch, tied), qtype)
    config = EngineConfig(model=str(path)).resolve()
    assert config.quantization == "gguf"  # "auto" on a file with quantized weights
    model = load_model(str(path), config.hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    for name, layer in linears(model).items():
        assert layer.qtype == qtype and layer.weight.dtype == torch.uint8, name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    reader = gguf.GGUFReader(str(path))
    file_bytes = {t.name: t.n_bytes for t in reader.tensors}
    assert linears(model)["down"].weight.numel() == file_bytes["blk.0.ffn_down.weight"]
    assert_parity(run_paged(model), hf_paged_reference(hf_from_gguf(path), VOCAB))


def greedy_or_near_tie(hf, prompt: list[int], ours: list[int]) -> None:
    """Our greedy tokens equal HF's; at a first divergence HF's logits of both tokens are a near-tie."""
    ids = list(prompt)
    for step, token in enumerate(ours):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        best = int(logits.argmax())
        if token != best:
            gap = float(logits[best] - logits[token])
            assert gap <= NEAR_TIE * max(1.0, float(logits.abs().max())), f"step {step}: {token} vs HF {best}, gap {gap}"
            return
        ids.append(token)


def assert_greedy_matches_hf(llm: LLM, path, prompts: list[list[int]]) -> None:
    """The engine's greedy tokens for ``prompts`` are HF's on the same file (near-tie rule); every KV block
    is free afterwards."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)  # plain argmax, like HF
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_from_gguf(path)
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == MAX_NEW
        greedy_or_near_tie(hf, prompt, out.outputs[0].token_ids)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("qtype", BLOCK_32_TYPES)
def test_engine_greedy_parity_with_hf_in_float32(tmp_path, tokenizer_dir, qtype):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=qtype != "Q8_0", seed=3), qtype)
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), dtype="float32", block_size=4,
              max_num_batched_tokens=8, kv_cache_memory="8MiB")  # 8-token budget: chunked prefill beside decodes
    try:
        assert llm.llm_engine.config.quantization == "gguf"
        rng = np.random.default_rng(7)
        assert_greedy_matches_hf(llm, path, [rng.integers(8, VOCAB, n).tolist() for n in (3, 11, 17)])
    finally:
        llm.shutdown()


def test_quantization_setting_is_resolved_and_validated(tmp_path, tiny_llama):
    quantized, floats = tmp_path / "q.gguf", tmp_path / "f.gguf"
    write_gguf(quantized, "llama", hf_weights("llama", tied=True), "Q4_0")
    write_gguf(floats, "llama", hf_weights("llama", tied=True), "F16")
    assert EngineConfig(model=str(quantized)).resolve().quantization == "gguf"
    assert EngineConfig(model=str(quantized), quantization="none").resolve().quantization == "none"
    assert EngineConfig(model=str(quantized), quantization=None).resolve().quantization == "none"
    assert EngineConfig(model=str(floats)).resolve().quantization == "none"
    assert EngineConfig(model=str(tiny_llama)).resolve().quantization == "none"
    with pytest.raises(ValueError, match="quantization: 'gguf' needs a GGUF model file"):
        EngineConfig(model=str(tiny_llama), quantization="gguf").resolve()
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(quantized), quantization="awq")


def test_forced_dequantized_load_is_the_float_model(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", hf_weights("qwen2", tied=False), "Q5_1")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    dense = load_model(str(path), hf_config, torch.float32, ParallelContext.single(), quantization="none")
    assert all(p.dtype == torch.float32 for p in dense.parameters())
    quantized = load_model(str(path), hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    assert sum(p.numel() * p.element_size() for p in quantized.parameters()) < 0.25 * sum(
        p.numel() * p.element_size() for p in dense.parameters())
    assert_parity(run_paged(quantized), run_paged(dense))  # seq -> position -> logits indexes like HF's


def test_fused_layer_with_mixed_formats_runs_in_floats(tmp_path, caplog):
    """llama.cpp may store q/k/v (or gate/up) in different types: that fused layer is dequantized, the
    others stay quantized, and the weights are the same."""
    path = tmp_path / "m.gguf"
    weights = hf_weights("llama", tied=False, seed=2)
    writer = new_writer(path, "llama")
    for name, w in weights.items():
        qtype = "Q8_0" if ".k_proj." in name or ".up_proj." in name else "Q4_1"
        if w.ndim == 2:
            stored = w
            if ".q_proj." in name or ".k_proj." in name:
                from tests.test_gguf_loader import llama_cpp_permute

                stored = llama_cpp_permute(w, HEADS if ".q_proj." in name else KV_HEADS)
            qt = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(stored, qt), raw_dtype=qt)
        else:
            writer.add_tensor(gguf_name(name), w)
    finish(writer)
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    with caplog.at_level(logging.DEBUG, logger="pagedserve.parallel.quant"):
        model = load_model(str(path), hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    layers = linears(model)
    assert layers["qkv"].qtype is None and layers["gate_up"].qtype is None
    assert layers["o"].qtype == layers["down"].qtype == "Q4_1" and layers["lm_head"].qtype == "Q4_1"
    assert "different formats" in caplog.text
    dense = load_model(str(path), hf_config, torch.float32, ParallelContext.single(), quantization="none")
    assert torch.equal(layers["qkv"].weight, linears(dense)["qkv"].weight)
    assert_parity(run_paged(model), hf_paged_reference(hf_from_gguf(path), VOCAB))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tensor_parallel_shards_hold_their_blocks(tmp_path, tp_rank):
    """Column-parallel ranks hold their rows, row-parallel ranks whole 32-element blocks of the input,
    vocabulary shards their rows: each equal to the matching slice of the file's block rows."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", hf_weights("qwen2", tied=False), "Q8_0")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    ctx = ParallelContext(rank=tp_rank, world_size=2, tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1)
    model = load_model(str(path), hf_config, torch.float32, ctx, quantization="gguf")
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    bb = 34  # Q8_0 bytes per block
    layers = linears(model)
    down = tensors["blk.0.ffn_down.weight"]  # [HIDDEN, INTER/32 blocks]: this rank's half of the blocks
    half = INTER // 2 // 32 * bb
    assert torch.equal(layers["down"].weight, down[:, tp_rank * half:(tp_rank + 1) * half])
    gate = tensors["blk.0.ffn_gate.weight"]
    assert torch.equal(layers["gate_up"].weight[: INTER // 2], gate[tp_rank * INTER // 2:(tp_rank + 1) * INTER // 2])
    v = tensors["blk.0.attn_v.weight"]  # one KV head per rank (2 KV heads, no permutation for v)
    head = HIDDEN // HEADS
    kv_rows = layers["qkv"].weight[-head:]
    assert torch.equal(kv_rows, v[tp_rank * head:(tp_rank + 1) * head])
    head_rows = tensors["output.weight"][tp_rank * VOCAB // 2:(tp_rank + 1) * VOCAB // 2]
    assert torch.equal(layers["lm_head"].weight, head_rows)


def test_tensor_parallel_size_that_splits_a_block_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    reference = write_gguf(path, "llama", hf_weights("llama", tied=True), "Q4_0")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    ctx = ParallelContext(rank=0, world_size=4, tp_rank=0, tp_size=4, pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 would split the 32-element Q4_0 blocks"):
        load_model(str(path), hf_config, torch.float32, ctx, quantization="gguf")
    # Dequantized, the same layout loads: the rank's columns cut out of the dequantized rows.
    model = load_model(str(path), hf_config, torch.float32, ctx, quantization="none")
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(o_proj, reference["model.layers.0.self_attn.o_proj.weight"][:, : HIDDEN // 4])


def test_quantized_and_dequantized_loads_hold_the_same_weights(tmp_path):
    """Every parameter of the quantized model dequantizes to the float model's parameter."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=False, seed=4), "Q5_0")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    quantized = load_model(str(path), hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    dense = load_model(str(path), hf_config, torch.float32, ParallelContext.single())
    from pagedserve.kernels.torch_impl.gguf_quant import dequantize_gguf

    for name, module in quantized.named_modules():
        qtype = getattr(module, "qtype", None)
        if qtype is not None:
            module.weight = torch.nn.Parameter(dequantize_gguf(module.weight.data, qtype), requires_grad=False)
    assert_same_params(quantized, dense)


def _tp_body(ctx: ParallelContext, path: str) -> None:
    hf_config = EngineConfig(model=path).resolve().hf_config
    reference = run_paged(load_model(path, hf_config, torch.float32, ParallelContext.single(), quantization="gguf"))
    model = load_model(path, hf_config, torch.float32, ctx, quantization="gguf")
    assert model.model.layers[0].mlp.down_proj.qtype == "Q4_1"
    assert_parity(run_paged(model), reference)


def test_tp2_quantized_model_matches_tp1(tmp_path):
    """Two gloo ranks, each with its quantized shards (row-parallel: half the blocks of each row), give
    the single-rank quantized model's logits."""
    from tests.test_parallel_layers import _spawn

    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", hf_weights("qwen2", tied=True, seed=5), "Q4_1")
    _spawn(tmp_path, 2, 2, 1, _tp_body, str(path))


def test_quantization_flags_reach_the_engine_config(tiny_llama):
    import argparse

    from pagedserve.bench import common
    from pagedserve.cluster.cli import build_parser, serve_args_from

    for command in (["serve"], ["generate", "--prompt", "x"]):
        ns = build_parser().parse_args([*command, str(tiny_llama), "--quantization", "none"])
        assert serve_args_from(ns).engine_kwargs()["quantization"] == "none"
    assert "quantization" not in serve_args_from(build_parser().parse_args(["serve", str(tiny_llama)])).engine_kwargs()
    parser = argparse.ArgumentParser()
    common.add_engine_args(parser)
    assert common.engine_kwargs(parser.parse_args(["-q", "none"]))["quantization"] == "none"
    assert "quantization" not in common.engine_kwargs(parser.parse_args([]))


def write_k_quant_gguf(path, qtypes: dict[str, str], seed: int = 0) -> None:
    """A Llama GGUF wide enough for 256-element super-blocks (hidden 256, MLP 512), its matrices in the
    K-quant ``qtypes[kind]`` (kind: a llama.cpp tensor name's last part, "*" for the rest): random blocks,
    as the `gguf` package cannot quantize K-quants (HF dequantizes the same file as the oracle)."""
    from tests.kernels.kernels_testutil import k_quant_blocks

    hidden, heads, kv_heads, inter, vocab, layers = 256, 4, 2, 512, VOCAB, 2
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    head = hidden // heads

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = name.split(".")[-2]
        qtype = gguf.GGMLQuantizationType[qtypes.get(kind, qtypes["*"])]
        writer.add_tensor(name, k_quant_blocks(qtype.name, rows, cols, rng), raw_dtype=qtype)

    matrix("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", (1 + 0.05 * rng.standard_normal(hidden)).astype(np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.05 * rng.standard_normal(hidden)).astype(np.float32))
        matrix(f"blk.{i}.attn_q.weight", heads * head, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head)
        matrix(f"blk.{i}.ffn_gate.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, inter)
    finish(writer)


@pytest.mark.parametrize("qtypes", [{"*": "Q4_K"}, {"*": "Q5_K"}, {"*": "Q6_K"},
                                    {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}],  # like Q4_K_M
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q4_K_M-like"])
def test_k_quant_model_matches_hf_logits(tmp_path, qtypes):
    path = tmp_path / "k.gguf"
    write_k_quant_gguf(path, qtypes)
    config = EngineConfig(model=str(path)).resolve()
    assert config.quantization == "gguf"
    model = load_model(str(path), config.hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    layers = linears(model)
    assert layers["down"].qtype == qtypes.get("ffn_down", qtypes["*"]) and layers["embed"].qtype == qtypes["*"]
    assert layers["qkv"].qtype == (None if "attn_v" in qtypes else qtypes["*"])  # mixed q/k/v: dequantized
    reference = hf_paged_reference(hf_from_gguf(path), VOCAB)
    assert_parity(run_paged(model), reference)
    dense = load_model(str(path), config.hf_config, torch.float32, ParallelContext.single(), quantization="none")
    assert_parity(run_paged(dense), reference)


def test_k_quant_tensor_parallel_needs_whole_super_blocks(tmp_path):
    path = tmp_path / "k.gguf"
    write_k_quant_gguf(path, {"*": "Q4_K"})
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    ctx = ParallelContext(rank=0, world_size=2, tp_rank=0, tp_size=2, pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 would split the 256-element Q4_K blocks"):
        load_model(str(path), hf_config, torch.float32, ctx, quantization="gguf")  # o_proj: 128 inputs per rank
    model = load_model(str(path), hf_config, torch.float32, ctx, quantization="none")
    assert model.model.layers[0].self_attn.o_proj.weight.shape == (256, 128)


@pytest.mark.parametrize("tied", [False, True])
def test_roofline_counts_the_weight_bytes_the_quantized_engine_holds(tmp_path, tied):
    """The benchmark roofline's W for a quantized run is the bytes of the matmul weights as loaded."""
    from pagedserve.bench.roofline import model_facts

    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=tied), "Q4_1")
    hf_config = EngineConfig(model=str(path)).resolve().hf_config
    model = load_model(str(path), hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    held = 0
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            held += module.weight.numel() * module.weight.element_size()
    held += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    facts = model_facts(str(path), "float32")
    assert facts.weight_bytes == held
    dense = model_facts(str(path), "float32", quantization="none")
    assert dense.quantized_weight_bytes is None and dense.weight_bytes > 4 * held
