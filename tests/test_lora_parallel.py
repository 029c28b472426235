"""Multi-LoRA under tensor parallelism on CPU with gloo (TP = 2, spawned ranks, as tests/test_parallel_layers.py
runs TP): A/B sharded like their base weights (column-parallel q/k/v and gate/up split B's output rows, KV
heads split or replicated; row-parallel o and down split A's input columns). Each rank loads the model,
installs the adapter in a resident slot through the worker's LoRAManager (read from the PEFT folder), and
the logits of a paged schedule (chunked prefills, decodes, a shared prefix) equal HF + PEFT's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pagedserve.engine.core.scheduler_output import NewRequestData, SchedulerOutput
from pagedserve.engine.lora.manager import LoRAManager
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.models.loader import load_model
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.parallel.state import ParallelContext
from tests.lora_adapters import make_adapter
from tests.test_models_parity import COMMON, assert_parity, hf_logits, run_paged
from tests.test_parallel_layers import _spawn

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_body(ctx: ParallelContext, model_dir: str, adapter: str, reference: dict) -> None:
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, hf_config, torch.float32, ctx)
    lora = LoRAManager(model, max_loras=2, max_rank=8, max_cpu_loras=2, device=torch.device("cpu"),
                       dtype=torch.float32)
    request = LoRARequest("adapter", 1, adapter)
    lora.update(SchedulerOutput([NewRequestData("r", [1], [], SamplingParams(), [], 0, set(), [], lora_request=request)], [], {},
                                0))
    wrapper = model.model.layers[0].self_attn.qkv_proj
    q_out = wrapper.base.q_size
    assert wrapper.b.shape[1] == wrapper.base.output_size_per_rank and q_out == 64 // 2  # B split by output rows
    assert model.model.layers[0].self_attn.o_proj.a.shape[2] == 64 // 2  # row-parallel: A split by input columns

    def forward(input_ids, positions, kv_caches, md):
        lora.prepare(["r"], np.array([len(input_ids)]))  # every token of the step under the adapter
        return model.compute_logits(model(input_ids, positions, kv_caches, md))

    assert lora.stats()["loads"] == 0
    assert_parity(run_paged(model, forward), reference)
    assert lora.stats()["loads"] == 1 and lora.stats()["disk_loads"] == 1


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tp2_lora_logits_match_peft(tmp_path: Path, kv_heads: int) -> None:
    from peft import PeftModel

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": kv_heads})
    config._attn_implementation = "eager"
    model_dir = tmp_path / "ckpt"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    adapter = make_adapter(model_dir, tmp_path / "adapter", 8, ALL, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(adapter)).eval()
    reference = hf_logits(peft_model, COMMON["vocab_size"])
    base_reference = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                               COMMON["vocab_size"])
    assert not torch.allclose(reference["A"], base_reference["A"], atol=1e-2)  # the adapter matters
    _spawn(tmp_path, 2, 2, 1, _lora_body, str(model_dir), str(adapter), reference)


@pytest.fixture(scope="module")
def local_ray():
    from tests.local_ray import fresh_local_ray

    with fresh_local_ray(num_cpus=4):
        yield


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_engine_mixed_batch_greedy_equals_peft(local_ray, tiny_llama, tmp_path: Path, tp: int, pp: int) -> None:
    """The whole engine over a Ray worker group (TP = 2: A/B sharded per rank; PP = 2: each stage's layers): one
    workload mixing two adapters of different ranks and targets with the base model, chunked prefill, greedy
    tokens equal to HF + PEFT's."""
    from pagedserve.engine import LLM
    from tests.lora_adapters import peft_greedy

    adapters = {"attn": LoRARequest("attn", 1, str(make_adapter(tiny_llama, tmp_path / "attn", 4, ["q_proj", "v_proj"],
                                                                 seed=41))),
                "all": LoRARequest("all", 2, str(make_adapter(tiny_llama, tmp_path / "all", 8, ALL, seed=42)))}
    prompts = [[(5 * k + 11 * i) % 400 + 20 for k in range(10 + 6 * i)] for i in range(3)]
    max_tokens = 6
    expected = {name: peft_greedy(tiny_llama, Path(lora.lora_path), prompts, max_tokens)
                for name, lora in adapters.items()}
    expected[None] = peft_greedy(tiny_llama, None, prompts, max_tokens)
    names = [None, "attn", "all"]
    work = [(i, names[(i + j) % 3]) for i in range(len(prompts)) for j in range(3)]
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=16,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray",
              enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i, _ in work],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False,
                            lora_request=[None if name is None else adapters[name] for _, name in work])
        assert [list(o.outputs[0].token_ids) for o in outs] == [expected[name][i] for i, name in work]
        stats = llm.get_stats()
        assert stats.lora["loads"] == 2 and stats.lora["requests"] == {"attn": 3, "all": 3}
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()
