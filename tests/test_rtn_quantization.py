"""quantization="int8" / "int4": a float (safetensors) checkpoint's linear layers quantized at load,
round-to-nearest per 32 weights into Q8_0 / Q4_1 blocks, and run through the GGUF kernels.

The oracle is HF transformers on the same checkpoint with each linear weight replaced by its quantized-
then-dequantized value (float32): logits within 1e-4, greedy output token for token. The quantizer
itself must write the bytes of llama.cpp's reference quantizer (`gguf.quants.quantize`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")

from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.config import EngineConfig  # noqa: E402
from pagedserve.engine.models.loader import RTN_WEIGHT_TYPES, load_model  # noqa: E402
from pagedserve.kernels.torch_impl.gguf_quant import dequantize_gguf, quantize_gguf  # noqa: E402
from pagedserve.parallel.state import ParallelContext  # noqa: E402
from tests.test_engine_parity import assert_all_blocks_free, random_prompts  # noqa: E402
from tests.test_gguf_quantized import greedy_or_near_tie  # noqa: E402
from tests.test_models_parity import assert_parity, build_checkpoint, hf_logits, run_paged  # noqa: E402


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantizer_writes_llama_cpp_bytes(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((20, 128)) * 0.3).astype(np.float32)
    w[0] = 0.0  # an all-zero group (scale 0)
    w[1] = 0.25  # a constant group (range 0)
    w[2, :32] = np.arange(32) * 0.5 - 8  # ties at .5 steps
    ours = quantize_gguf(torch.from_numpy(w), qtype)
    assert np.array_equal(ours.numpy(), gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]))
    assert quantize_gguf(torch.from_numpy(w).to(torch.bfloat16), qtype).shape == ours.shape
    with pytest.raises(ValueError, match="qtype"):
        quantize_gguf(torch.from_numpy(w), "Q4_K")


def round_trip_hf(hf_model, qtype: str):
    """HF's model with every linear layer's weight quantized and dequantized as ours is (those whose input
    is a whole number of 32-weight groups: the others stay float in ours too)."""
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if (isinstance(module, torch.nn.Linear) and name.split(".")[-1].endswith("_proj")
                    and module.in_features % 32 == 0):
                module.weight.copy_(dequantize_gguf(quantize_gguf(module.weight, qtype), qtype))
    return hf_model


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("config_cls,overrides", [
    (transformers.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
], ids=["llama_tied_bias", "qwen3_qknorm"])
def test_rtn_model_matches_hf_on_round_tripped_weights(tmp_path, quantization, config_cls, overrides):
    hf_config, hf_model = build_checkpoint(config_cls, tmp_path, **overrides)
    qtype = RTN_WEIGHT_TYPES[quantization]
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single(), quantization=quantization)
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.qtype == qtype and linear.weight.dtype == torch.uint8
    assert model.model.embed_tokens.qtype is None and model.lm_head.qtype is None  # they stay float
    assert_parity(run_paged(model), hf_logits(round_trip_hf(hf_model, qtype), hf_config.vocab_size))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_layers_not_a_whole_number_of_groups_stay_float(tmp_path, quantization, caplog):
    """A checkpoint whose MLP is 72 wide (not a multiple of 32): down_proj stays float, with one warning,
    the rest is quantized, and the logits match HF with exactly those layers round-tripped."""
    hf_config, hf_model = build_checkpoint(transformers.LlamaConfig, tmp_path, intermediate_size=72)
    qtype = RTN_WEIGHT_TYPES[quantization]
    with caplog.at_level("WARNING"):
        model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single(), quantization=quantization)
    warnings = [r.getMessage() for r in caplog.records if "whole number" in r.getMessage()]
    assert len(warnings) == 1 and "72 wide" in warnings[0] and "down_proj" in warnings[0]
    for layer in model.model.layers:
        assert layer.mlp.down_proj.qtype is None and layer.mlp.down_proj.weight.dtype == torch.float32
        assert layer.mlp.gate_up_proj.qtype == qtype and layer.self_attn.qkv_proj.qtype == qtype
        assert layer.self_attn.o_proj.qtype == qtype
    assert_parity(run_paged(model), hf_logits(round_trip_hf(hf_model, qtype), hf_config.vocab_size))


def test_model_too_narrow_for_any_group_runs_in_floats(tiny_model_factory):
    """hidden 40, MLP 72: no linear layer can be quantized; the engine runs it as the float model, token for token."""
    path = tiny_model_factory("llama", hidden_size=40, num_attention_heads=5, num_key_value_heads=5, head_dim=8,
                              intermediate_size=72)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, [4, 19])]
    outputs = {}
    for quantization in ("int4", "none"):
        llm = LLM(model=str(path), dtype="float32", quantization=quantization, block_size=4, kv_cache_memory="16MiB")
        try:
            outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    assert outputs["int4"] == outputs["none"]


def test_int4_engine_greedy_parity(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("qwen2")
    hf = round_trip_hf(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), "Q4_1")
    llm = LLM(model=str(path), dtype="float32", quantization="int4", block_size=4, max_num_batched_tokens=8,
              kv_cache_memory="16MiB")
    try:
        assert llm.llm_engine.config.quantization == "int4"
        prompts = random_prompts(3, [3, 9, 21])
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)  # plain argmax, as HF's below
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            greedy_or_near_tie(hf, prompt, out.outputs[0].token_ids)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_rtn_setting_is_validated(tmp_path, tiny_llama):
    from tests.test_gguf_loader import hf_weights, write_gguf

    assert EngineConfig(model=str(tiny_llama), quantization="int8").resolve().quantization == "int8"
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=True), "F16")
    with pytest.raises(ValueError, match="quantization: 'int4' quantizes a float"):
        EngineConfig(model=str(path), quantization="int4").resolve()


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_rtn_tensor_parallel_ranks_quantize_their_own_slice(tmp_path, tp_rank):
    hf_config, hf_model = build_checkpoint(transformers.LlamaConfig, tmp_path, intermediate_size=128)
    ctx = ParallelContext(rank=tp_rank, world_size=2, tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1)
    model = load_model(str(tmp_path), hf_config, torch.float32, ctx, quantization="int8")
    down = hf_model.model.layers[0].mlp.down_proj.weight.detach()  # [64, 128]: this rank's 64 input columns
    expected = quantize_gguf(down[:, tp_rank * 64:(tp_rank + 1) * 64], "Q8_0")
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expected)
    # 96 // 2 = 48 inputs per rank would split a 32-weight group: refused, naming the field.
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path / "odd")
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 would split the 32-element Q8_0 blocks"):
        load_model(str(tmp_path / "odd"), hf_config, torch.float32, ctx, quantization="int8")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_roofline_counts_the_weight_bytes_the_rtn_engine_holds(tmp_path, quantization):
    from pagedserve.bench.roofline import model_facts

    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path, intermediate_size=128)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single(), quantization=quantization)
    held = sum(m.weight.numel() * m.weight.element_size() for layer in model.model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    held += model.lm_head.weight.numel() * 4  # float32 LM head
    assert model_facts(str(tmp_path), "float32", quantization=quantization).weight_bytes == held
