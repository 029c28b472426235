"""The bundled default model and its draft (issue 6): they load offline through
`transformers` and our engine, reproduce the held-out loss recorded in the model
card, complete Python sensibly, and our engine's greedy output equals HF's."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TARGET = ASSETS / "default-model"
DRAFT = ASSETS / "draft-model"
MODELS = {"target": TARGET, "draft": DRAFT}
PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass ", "    for i in range(len(items)):\n"]
# The card's slice loss is computed by training/evaluate.py exactly as below
# (float32 weights upcast from the same bf16 file, same token windows); only the
# summation order of the CPU kernels can differ (thread count), worth ~1e-5.
# A different tokenizer, split or set of weights moves it by tenths of a nat.
SLICE_LOSS_TOLERANCE = 0.01


@pytest.fixture(scope="module", params=sorted(MODELS))
def bundled(request):
    path = MODELS[request.param]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, tokenizer, model


def test_bundled_models_are_small_bf16_llamas_with_tokenizer(bundled):
    kind, path, tokenizer, model = bundled
    assert model.config.model_type == "llama"
    n_params = sum(p.numel() for p in model.parameters())
    if kind == "target":
        assert 10e6 <= n_params <= 20e6
    else:
        target_params = json.loads((TARGET / "training_stats.json").read_text())["parameters"]
        assert n_params * 5 <= target_params
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|eos|>" and tokenizer.pad_token == "<|pad|>"
    assert len(tokenizer) == model.config.vocab_size
    gen = model.generation_config
    assert gen.bos_token_id == tokenizer.bos_token_id
    assert tokenizer.eos_token_id in gen.eos_token_id
    assert tokenizer(["x = 1"]).input_ids[0][0] == tokenizer.bos_token_id
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\n"


def test_shipped_assets_fit_the_size_budget():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 50 * 2**20


def test_heldout_slice_loss_matches_model_card(bundled):
    kind, path, tokenizer, model = bundled
    card = json.loads((path / "eval_stats.json").read_text())
    if card["python_version"] != sys.version.split()[0]:
        pytest.skip(f"held-out split is defined on CPython {card['python_version']}'s stdlib")
    from training.data import encode_split, eval_windows
    from training.evaluate import window_losses

    windows = eval_windows(encode_split(tokenizer, "heldout"), card["seq_len"], card["slice_windows"])
    loss = float(window_losses(model, windows).mean())
    assert abs(loss - card["slice_loss"]) < SLICE_LOSS_TOLERANCE
    # Far below a uniform guess over the vocabulary: the model learned Python.
    assert loss < 0.6 * math.log(model.config.vocab_size)


def test_fibonacci_greedy_continuation_is_an_indented_body():
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=32)
    completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # The header is followed by a newline and an indented, non-empty line.
    assert re.match(r"[ \t]*\n([ \t]*\n)*[ \t]+\S", completion), completion


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_engine_greedy_equals_hf_on_bundled_models(kind):
    from pagedserve.engine import LLM, SamplingParams

    path = MODELS[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="256MiB")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, result in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, do_sample=False, max_new_tokens=32)[0, ids.shape[1]:].tolist()
        assert list(result.outputs[0].token_ids) == expected, prompt
