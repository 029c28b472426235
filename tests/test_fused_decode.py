"""The fused CPU decode op (kernels/cpu/decode_layers.cpp, engine/models/fused_decode.py) against the
layer-by-layer path it replaces: same hidden states and the same K/V written, bit for bit, for every model
shape we support (biases, qk-norm, head_dim != hidden/heads, sliding windows, GQA), float32 and bfloat16,
float weights and every GGUF / RTN quantized format; and the cases that must keep the layer path."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.lora.manager import LoRAContext, wrap_model
from pagedserve.engine.models import fused_decode
from pagedserve.engine.models.fused_decode import FusedDecodeStack
from pagedserve.engine.models.loader import load_model
from pagedserve.kernels.cpu.build import cpu_ops_available
from pagedserve.parallel.state import ParallelContext
from tests.test_gguf_loader import hf_weights, write_gguf
from tests.test_gguf_quantized import BLOCK_32_TYPES, write_k_quant_gguf
from tests.test_models_parity import CASES, CopyInHooks, PagedBatcher, build_checkpoint, make_kv_caches

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the compiled CPU ops did not build")

DECODE_STEPS = 4


class CountingStack:
    """Counts the decode steps that took the fused op."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        run = FusedDecodeStack.run

        def counted(stack, *args, **kwargs):
            self.calls += 1
            return run(stack, *args, **kwargs)

        monkeypatch.setattr(FusedDecodeStack, "run", counted)


def run_steps(model, fused: bool, dtype: torch.dtype):
    """Prefill three sequences, then DECODE_STEPS all-decode steps; every step's hidden states and the final caches."""
    model.fused_decode = fused
    vocab = model.spec.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = {s: torch.randint(0, vocab, (n,), generator=g).tolist() for s, n in (("A", 9), ("B", 3), ("C", 14))}
    batcher = PagedBatcher()
    for s in prompts:
        batcher.add(s)
    kv_caches = make_kv_caches(model, dtype)
    hiddens = []
    steps = [[(s, t) for s, t in prompts.items()]]
    steps += [[(s, [int(torch.randint(0, vocab, (1,), generator=g))]) for s in prompts] for _ in range(DECODE_STEPS)]
    steps.append([("A", [3])])  # a batch of one
    for chunks in steps:
        input_ids, positions, md = batcher.step(chunks)
        with torch.inference_mode():
            hiddens.append(model(input_ids, positions, kv_caches, md))
    return hiddens, kv_caches


def assert_same_run(model, dtype: torch.dtype, monkeypatch) -> None:
    counter = CountingStack(monkeypatch)
    fused_hidden, fused_caches = run_steps(model, True, dtype)
    assert counter.calls == DECODE_STEPS + 1, "every all-decode step takes the fused op (the prefill step does not)"
    eager_hidden, eager_caches = run_steps(model, False, dtype)
    assert counter.calls == DECODE_STEPS + 1
    for step, (a, b) in enumerate(zip(fused_hidden, eager_hidden)):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max()}"
    for (fk, fv), (ek, ev) in zip(fused_caches, eager_caches):
        assert torch.equal(fk, ek) and torch.equal(fv, ev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_decode_is_the_layer_path_bit_for_bit(tmp_path, case, dtype, monkeypatch):
    config_cls, overrides = CASES[case]
    overrides = {k: v for k, v in overrides.items() if not k.startswith("_")}
    hf_config, _ = build_checkpoint(config_cls, tmp_path, **overrides)
    model = load_model(str(tmp_path), hf_config, dtype, ParallelContext.single())
    assert_same_run(model, dtype, monkeypatch)


@pytest.mark.parametrize("qtype", BLOCK_32_TYPES)
def test_fused_decode_with_gguf_weights(tmp_path, qtype, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", hf_weights("qwen2", tied=False), qtype)  # qwen2: q/k/v biases on quantized weights
    config = EngineConfig(model=str(path)).resolve()
    model = load_model(str(path), config.hf_config, torch.bfloat16, ParallelContext.single(), quantization="gguf")
    assert model.model.layers[0].mlp.down_proj.qtype == qtype
    assert_same_run(model, torch.bfloat16, monkeypatch)


@pytest.mark.parametrize("qtypes", [{"*": "Q4_K"}, {"*": "Q6_K"}, {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_K"}],
                         ids=["Q4_K", "Q6_K", "mixed-float-qkv"])
def test_fused_decode_with_k_quants(tmp_path, qtypes, monkeypatch):
    path = tmp_path / "k.gguf"
    write_k_quant_gguf(path, qtypes)
    config = EngineConfig(model=str(path)).resolve()
    model = load_model(str(path), config.hf_config, torch.float32, ParallelContext.single(), quantization="gguf")
    assert_same_run(model, torch.float32, monkeypatch)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_fused_decode_with_rtn_weights(tmp_path, quantization, monkeypatch):
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path, attention_bias=True, mlp_bias=True)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single(), quantization=quantization)
    assert model.model.layers[0].self_attn.o_proj.qtype is not None
    assert_same_run(model, torch.float32, monkeypatch)


def test_lora_wrapped_models_keep_the_layer_path(tmp_path):
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    assert FusedDecodeStack.for_model(model) is not None
    wrap_model(model, LoRAContext(), max_loras=2, max_rank=8)
    assert FusedDecodeStack.for_model(model) is None


def test_steps_with_layer_load_hooks_keep_the_layer_path(tmp_path, monkeypatch):
    """A KV connector's wait_for_layer_load must run before each layer reads its cache: not through the op."""
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    counter = CountingStack(monkeypatch)
    batcher = PagedBatcher()
    batcher.add("A")
    kv_caches = make_kv_caches(model)
    hooks = CopyInHooks(make_kv_caches(model), kv_caches)
    for chunk in ([1, 2, 3], [4]):
        input_ids, positions, md = batcher.step([("A", chunk)])
        with torch.inference_mode():
            model(input_ids, positions, kv_caches, md, kv_hooks=hooks)
    assert counter.calls == 0
    assert [c for c in hooks.calls if c[0] == "wait"] == [("wait", 0), ("wait", 1)] * 2


def test_engine_output_is_the_same_with_and_without_the_op(tiny_llama, monkeypatch):
    """Through the engine (scheduler, sampler, logprobs): identical tokens and logprobs, and the op ran."""
    counter = CountingStack(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = []
    for eager in (False, True):
        llm = LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", block_size=4, enforce_eager=eager)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
        if not eager:
            assert counter.calls > 0
            calls = counter.calls
    assert counter.calls == calls, "enforce_eager runs every step layer by layer"
    for fused_out, eager_out in zip(*results):
        a, b = fused_out.outputs[0], eager_out.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_ineligible_reasons(tmp_path, monkeypatch):
    hf_config, _ = build_checkpoint(transformers.LlamaConfig, tmp_path)
    model = load_model(str(tmp_path), hf_config, torch.float32, ParallelContext.single())
    assert fused_decode._ineligible_reason(model) is None
    # A model off the CPU is refused before the compiled CPU ops are asked for (they would be built).
    monkeypatch.setattr(fused_decode, "decode_layers_available", lambda: pytest.fail("CPU ops asked for"))
    weight = model.model.norm.weight
    model.model.norm.weight = torch.nn.Parameter(torch.empty(64, device="meta"), requires_grad=False)
    assert fused_decode._ineligible_reason(model) == "weights not on the CPU"
    monkeypatch.undo()
    model.model.norm.weight = weight
    assert fused_decode._ineligible_reason(model) is None
    model.model.layers[1].post_attention_layernorm.weight.data = torch.ones(64, dtype=torch.float64)
    assert fused_decode._ineligible_reason(model) == "norm weight dtype"
