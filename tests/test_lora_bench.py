"""benchmarks/lora.py on a tiny workload: the report has every setup the README's table shows for each adapter
count (adapter loads counted, no swaps with every adapter resident), the merged engines' greedy tokens equal the
multi-LoRA engine's and the adapters change them; merging adds the scaled B A to the targeted weights. No timing
is asserted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "lora.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lora_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_bench_reports_every_setup(bench, tmp_path):
    out = tmp_path / "lora.json"
    assert bench.main(["--adapters", "1", "3", "--requests", "6", "--prompt", "12", "--output", "4", "--repeats", "1",
                       "--kv-cache-memory", "16MiB", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [g["adapters"] for g in report["groups"]] == [1, 3]
    for group in report["groups"]:
        k = group["adapters"]
        assert (group["base"]["engines"], group["multi_lora"]["engines"], group["merged_per_engine"]["engines"]) == \
            (1, 1, k)
        for setup in ("base", "multi_lora", "merged_per_engine"):
            assert group[setup]["seconds"] > 0 and group[setup]["output_tokens_per_s"] > 0
        assert group["multi_lora"]["lora"] == {"loads": k, "evictions": 0, "disk_loads": k}  # all resident
        # W x + B A x and (W + B A) x round differently: a near tie may flip, a wrong merge would flip most
        assert group["same_greedy_tokens_as_merged"] >= 0.8
        assert group["differ_from_base"] > 0  # the adapters matter
        assert group["multi_lora_vs_base"] > 0 and group["multi_lora_vs_merged_per_engine"] > 0

def test_merging_an_adapter_adds_its_scaled_product_to_the_targeted_weights(bench, tiny_llama, tmp_path):
    from safetensors.torch import load_file

    adapter = bench.make_adapter(tiny_llama, tmp_path / "adapter", rank=4, alpha=8, seed=3)
    merged = bench.merge_adapter(tiny_llama, adapter, tmp_path / "merged")
    base, out = load_file(str(tiny_llama / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    a = lora["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = lora["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert out[key].shape == base[key].shape
    assert (out[key] - base[key] - 2.0 * (b @ a)).abs().max() < 1e-6
    assert all((out[k] == base[k]).all() for k in base if "proj" not in k)  # norms, embeddings untouched


def test_the_readme_table_shows_the_committed_run():
    """README "LoRA adapters": its throughput table is benchmarks/results/lora-cpu.json's (rerun the command there
    and update both together)."""
    root = Path(__file__).resolve().parent.parent
    report = json.loads((root / "benchmarks" / "results" / "lora-cpu.json").read_text())
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## LoRA adapters"):readme.index("## Disaggregated prefill/decode")]
    for group in report["groups"]:
        rate = {name: group[name]["output_tokens_per_s"] for name in ("base", "multi_lora", "merged_per_engine")}
        row = (f"| {group['adapters']:<10} | {rate['base']:<10.0f} | {rate['multi_lora']:<22.0f} | "
               f"{rate['merged_per_engine']:<17.0f} | {group['multi_lora_vs_base']:<17.2f} | "
               f"{group['multi_lora_vs_merged_per_engine']:<19.2f} |")
        assert row in section, row
