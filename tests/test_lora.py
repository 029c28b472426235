"""Multi-LoRA serving in the engine: greedy output under each adapter equals HF transformers + PEFT token for
token (float32), alone and in batches that mix adapters and the base model, with chunked prefill, prefix
hits (never across adapters), preemption, swaps through fewer resident slots than adapters, and bad
adapters refused with a ValueError naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter, peft_greedy

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * k + 3 * i) % 400 + 20 for k in range(9 + 5 * i)] for i in range(4)]
PROMPT_DICTS = [{"prompt_token_ids": p} for p in PROMPTS]

# (rank, target modules, alpha, use_rslora): different ranks and targets, attention-only to everything
ADAPTERS = {
    "attn-r4": (4, ["q_proj", "v_proj"], 16, False),
    "all-r8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, False),
    "mlp-r2": (2, ["gate_proj", "up_proj", "down_proj", "o_proj"], 4, True),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items()):
        path = make_adapter(tiny_llama, root / name, rank, targets, seed=100 + i, alpha=alpha, use_rslora=rslora)
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters) -> dict[str | None, list[list[int]]]:
    """HF + PEFT greedy tokens of every prompt under each adapter and the base model (None)."""
    table = {None: peft_greedy(tiny_llama, None, PROMPTS, MAX_TOKENS)}
    for name, lora in adapters.items():
        table[name] = peft_greedy(tiny_llama, Path(lora.lora_path), PROMPTS, MAX_TOKENS)
        assert table[name] != table[None], f"adapter {name} does not change the greedy tokens"
    return table


def _llm(model: Path, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128, "enable_lora": True, "max_loras": 4,
              "max_lora_rank": 8, **kwargs}
    return LLM(model=str(model), **kwargs)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _assert_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_each_adapter_alone_matches_peft(tiny_llama, adapters, expected):
    llm = _llm(tiny_llama)
    for name, lora in adapters.items():
        assert _tokens(llm.generate(PROMPT_DICTS, GREEDY, use_tqdm=False, lora_request=lora)) == expected[name]
    assert _tokens(llm.generate(PROMPT_DICTS, GREEDY, use_tqdm=False)) == expected[None]
    _assert_all_free(llm)


def _mixed(adapters) -> tuple[list[list[int]], list[LoRARequest | None], list[str | None]]:
    """Every prompt under every adapter and the base model, interleaved in one workload."""
    names = [None, *adapters]
    prompts, loras, keys = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            prompts.append(prompt)
            loras.append(None if name is None else adapters[name])
            keys.append(name)
    return prompts, loras, keys


def _expected_for(expected, keys) -> list[list[int]]:
    return [expected[k][PROMPTS.index(p)] for k, p in keys]


@pytest.mark.parametrize("chunked", [False, True])
def test_one_batch_mixes_three_adapters_and_the_base_model(tiny_llama, adapters, expected, chunked):
    kwargs = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True} if chunked else {}
    llm = _llm(tiny_llama, enable_prefix_caching=False, **kwargs)
    prompts, loras, keys = _mixed(adapters)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                               lora_request=loras))
    assert got == _expected_for(expected, list(zip(keys, prompts)))
    stats = llm.get_stats()
    assert stats.lora["loads"] == 3 and stats.lora["evictions"] == 0
    assert stats.lora["requests"] == {name: len(PROMPTS) for name in adapters}
    assert sorted(stats.lora["resident"]) == sorted(adapters)
    _assert_all_free(llm)


def test_more_adapters_than_slots_swap_in_lru_order_and_stay_exact(tiny_llama, adapters, expected):
    llm = _llm(tiny_llama, max_loras=1, max_cpu_loras=2, enable_prefix_caching=False)
    prompts, loras, keys = _mixed(adapters)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                               lora_request=loras))
    assert got == _expected_for(expected, list(zip(keys, prompts)))
    lora = llm.get_stats().lora
    assert lora["loads"] >= 3 and lora["evictions"] == lora["loads"] - 1  # one slot: each load evicts the last
    assert lora["disk_loads"] >= 3
    _assert_all_free(llm)



def test_resident_slots_evict_the_least_recently_used_and_swap_in_from_host_memory(tiny_llama, adapters, expected):
    llm = _llm(tiny_llama, max_loras=2, max_cpu_loras=3)
    a, b, c = (adapters[name] for name in ("attn-r4", "all-r8", "mlp-r2"))

    def run(lora, loads, evictions, disk_loads, resident):
        got = _tokens(llm.generate(PROMPT_DICTS[:1], GREEDY, use_tqdm=False, lora_request=lora))
        assert got == [expected[lora.lora_name][0]]
        stats = llm.get_stats().lora
        assert (stats["loads"], stats["evictions"], stats["disk_loads"]) == (loads, evictions, disk_loads)
        assert sorted(stats["resident"]) == sorted(r.lora_name for r in resident)

    run(a, 1, 0, 1, [a])
    run(b, 2, 0, 2, [a, b])
    run(a, 2, 0, 2, [a, b])  # resident: no load
    run(c, 3, 1, 3, [a, c])  # b, the least recently used, makes room (not a, loaded first)
    run(b, 4, 2, 3, [c, b])  # back from host memory, not from disk; a is now the least recently used
    _assert_all_free(llm)


def test_prefix_cache_hits_only_within_one_adapter(tiny_llama, adapters, expected):
    llm = _llm(tiny_llama)
    prompt = {"prompt_token_ids": PROMPTS[3]}  # 24 tokens: five full blocks of 4 are cacheable
    a, b = adapters["attn-r4"], adapters["all-r8"]

    def run(lora):
        return llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]

    first = run(a)
    assert first.num_cached_tokens == 0 and list(first.outputs[0].token_ids) == expected["attn-r4"][3]
    again = run(a)
    assert again.num_cached_tokens == 20 and list(again.outputs[0].token_ids) == expected["attn-r4"][3]
    other = run(b)  # same tokens, another adapter: no hit on a's blocks
    assert other.num_cached_tokens == 0 and list(other.outputs[0].token_ids) == expected["all-r8"][3]
    base = run(None)
    assert base.num_cached_tokens == 0 and list(base.outputs[0].token_ids) == expected[None][3]
    assert run(None).num_cached_tokens == 20
    _assert_all_free(llm)


def test_preempted_adapter_requests_recompute_exactly(tiny_llama, adapters, expected):
    # 14 blocks of 4 tokens cannot hold 16 sequences of up to 30 tokens: requests are preempted and recomputed.
    llm = _llm(tiny_llama, num_kv_blocks=14, max_num_seqs=16, enable_prefix_caching=False, max_loras=2)
    prompts, loras, keys = _mixed(adapters)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                               lora_request=loras))
    assert got == _expected_for(expected, list(zip(keys, prompts)))
    assert llm.get_stats().num_preemptions > 0
    _assert_all_free(llm)


def _write_adapter_variant(src: Path, dst: Path, **config_changes) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_adapters_that_do_not_fit_are_value_errors_naming_why(tiny_llama, tiny_model_factory, adapters, expected,
                                                              tmp_path):
    llm = _llm(tiny_llama, max_lora_rank=4)
    one = [{"prompt_token_ids": PROMPTS[0]}]
    with pytest.raises(ValueError, match="r=8 exceeds max_lora_rank=4"):
        llm.generate(one, GREEDY, use_tqdm=False, lora_request=adapters["all-r8"])
    wider = tiny_model_factory("llama", hidden_size=96)
    other_base = make_adapter(wider, tmp_path / "wide", 2, ["q_proj"], seed=7)
    with pytest.raises(ValueError, match="base model mismatch: .*q_proj.lora_A is \\[2, 96\\].*\\[2, 64\\]"):
        llm.generate(one, GREEDY, use_tqdm=False, lora_request=LoRARequest("wide", 9, str(other_base)))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        llm.generate(one, GREEDY, use_tqdm=False, lora_request=LoRARequest("nowhere", 10, str(tmp_path)))
    dora = _write_adapter_variant(Path(adapters["attn-r4"].lora_path), tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        llm.generate(one, GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 11, str(dora)))
    with pytest.raises(ValueError, match="lora_int_id: 1 already names adapter 'attn-r4'"):
        llm.generate(one * 2, GREEDY, use_tqdm=False,
                     lora_request=[adapters["attn-r4"], LoRARequest("x", 1, str(other_base))])
    # the engine goes on, exact
    assert _tokens(llm.generate(one, GREEDY, use_tqdm=False, lora_request=adapters["attn-r4"])) == \
        [expected["attn-r4"][0]]
    _assert_all_free(llm)


def test_lora_request_needs_enable_lora_and_a_well_formed_request(tiny_llama, adapters):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="started without enable_lora"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=adapters["attn-r4"])
    with pytest.raises(ValueError, match="lora_int_id: expected an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="max_cpu_loras: 1 is fewer than max_loras"):
        LLM(model=str(tiny_llama), enable_lora=True, max_loras=2, max_cpu_loras=1)
