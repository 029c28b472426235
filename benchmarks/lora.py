"""Multi-LoRA throughput: one engine serving 1, 4 or 16 adapters mixed uniformly in its batches, against the base
model alone on the same workload (the cost of LoRA) and against each adapter merged into its own engine, each
engine serving its adapter's share of the requests (the point of multi-LoRA: one replica instead of one per
adapter). A random-weight model and random PEFT-format adapters (rank `--rank`, every q/k/v/o and MLP
projection): nothing to download.

    python benchmarks/lora.py [--adapters 1 4 16 --requests 64 --prompt 128 --output 32 --rank 8 --json OUT]

For each adapter count k the three setups run side by side in one process: the base engine, the multi-LoRA
engine and the k merged engines. Each serves one warm-up request per adapter first (adapters are then in host
memory and, with --max-loras at least k, resident: the steady state of a server that already served them).
Then --repeats rounds each run the workload on the base engine, on the multi-LoRA engine and on the merged
engines one after another (each its share of the requests: their throughput is all their tokens over the sum
of their times, as if each had 1/k of the device); the fastest round of each setup counts (the least disturbed
on a shared machine, and the three alternate, so a slow spell does not fall on one setup). Also reported:
the share of greedy tokens equal to the merged engines' (rounding differs between W x + B A x and (W + B A) x,
so a near tie may go the other way on a random-weight model), and the share that differ from the base model's
(the adapters matter).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve.bench.random_model import make_random_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.lora.adapter import module_shapes
from pagedserve.engine.lora.request import LoRARequest

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapter(model: Path, out: Path, rank: int, alpha: int, seed: int) -> Path:
    """A random PEFT LoRA folder for `model` (adapter_config.json + adapter_model.safetensors), every target."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, block in TARGETS.items():
            in_features, out_features = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / math.sqrt(in_features)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.05
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(TARGETS), "bias": "none",
        "base_model_name_or_path": str(model)}))
    return out


def merge_adapter(model: Path, adapter: Path, out: Path) -> Path:
    """`model` with the adapter merged into its weights (W + lora_alpha / r * B A), saved as its own model."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    shutil.copytree(model, out)
    weights = load_file(str(model / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scaling * (b @ a).to(weights[name].dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _engine(model: Path, ns: argparse.Namespace, adapters: int) -> LLM:
    kwargs = dict(model=str(model), dtype="float32", block_size=16, kv_cache_memory=ns.kv_cache_memory,
                  max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens, seed=ns.seed)
    if adapters:
        kwargs.update(enable_lora=True, max_loras=min(adapters, ns.max_loras), max_lora_rank=ns.rank,
                      max_cpu_loras=adapters)
    return LLM(**kwargs)


def _warm(llm: LLM, prompt: list[int], warm: list[LoRARequest | None]) -> None:
    """One short request per adapter (each is then in host memory, and resident when the slots hold them all)."""
    llm.generate([{"prompt_token_ids": prompt[:8]}] * len(warm), SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False, lora_request=warm if any(warm) else None)


def _timed(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None] | None,
           params: SamplingParams) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outs]


def _figures(seconds: float, tokens: list[list[int]], prompts: list[list[int]]) -> dict:
    generated = sum(len(t) for t in tokens)
    return {"seconds": round(seconds, 3), "output_tokens_per_s": round(generated / seconds, 1),
            "tokens_per_s": round((generated + sum(len(p) for p in prompts)) / seconds, 1)}


def _group(model: Path, root: Path, ns: argparse.Namespace, prompts: list[list[int]], adapters: list[LoRARequest],
           params: SamplingParams) -> dict:
    """Base alone, k adapters in one engine and k merged engines, measured in alternating rounds (so that the three
    see the same background load); the fastest round of each counts."""
    k = len(adapters)
    loras = [adapters[i % k] for i in range(len(prompts))]  # uniform mix, interleaved in arrival order
    shares = [[i for i in range(len(prompts)) if i % k == j] for j in range(k)]
    engines: list[LLM] = []
    try:
        base = _engine(model, ns, 0)
        multi = _engine(model, ns, k)
        engines += [base, multi]
        merged = []
        for j, lora in enumerate(adapters):  # adapter j merged into its own engine, serving its share
            merged.append(_engine(merge_adapter(model, Path(lora.lora_path), root / f"merged{j}"), ns, 0))
            engines.append(merged[-1])
        _warm(base, prompts[0], [None])
        _warm(multi, prompts[0], list(adapters))
        for llm in merged:
            _warm(llm, prompts[0], [None])
        best = {"base": math.inf, "multi": math.inf, "merged": math.inf}
        tokens: dict[str, list] = {}
        for _ in range(ns.repeats):
            seconds, tokens["base"] = _timed(base, prompts, None, params)
            best["base"] = min(best["base"], seconds)
            seconds, tokens["multi"] = _timed(multi, prompts, loras, params)
            best["multi"] = min(best["multi"], seconds)
            total, tokens["merged"] = 0.0, [None] * len(prompts)
            for llm, share in zip(merged, shares):
                seconds, got = _timed(llm, [prompts[i] for i in share], None, params)
                total += seconds
                for i, t in zip(share, got):
                    tokens["merged"][i] = t
            best["merged"] = min(best["merged"], total)
        lora_stats = {key: multi.get_stats().lora[key] for key in ("loads", "evictions", "disk_loads")}
    finally:
        for llm in engines:
            llm.shutdown()
        for j in range(k):
            shutil.rmtree(root / f"merged{j}", ignore_errors=True)
    out = {
        "adapters": k,
        "base": {"engines": 1, **_figures(best["base"], tokens["base"], prompts)},
        "multi_lora": {"engines": 1, **_figures(best["multi"], tokens["multi"], prompts), "lora": lora_stats},
        "merged_per_engine": {"engines": k, **_figures(best["merged"], tokens["merged"], prompts)},
    }
    rate = {name: out[name]["output_tokens_per_s"] for name in ("base", "multi_lora", "merged_per_engine")}
    out["multi_lora_vs_base"] = round(rate["multi_lora"] / rate["base"], 3)
    out["multi_lora_vs_merged_per_engine"] = round(rate["multi_lora"] / rate["merged_per_engine"], 3)
    out["merged_per_engine_vs_base"] = round(rate["merged_per_engine"] / rate["base"], 3)
    n = len(prompts)
    out["same_greedy_tokens_as_merged"] = round(sum(a == b for a, b in zip(tokens["multi"], tokens["merged"])) / n, 3)
    out["differ_from_base"] = round(sum(a != b for a, b in zip(tokens["multi"], tokens["base"])) / n, 3)
    return out


def run(ns: argparse.Namespace, root: Path) -> dict:
    rng = random.Random(ns.seed)
    model = make_random_model(ns.model_size, root, dtype="float32", seed=ns.seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(ns.prompt)] for _ in range(ns.requests)]
    params = SamplingParams(max_tokens=ns.output, temperature=0, ignore_eos=True)
    adapters = [LoRARequest(f"lora{i}", i + 1, str(make_adapter(model, root / f"lora{i}", ns.rank, 2 * ns.rank,
                                                                 ns.seed + i))) for i in range(max(ns.adapters))]
    report: dict = {"workload": {k: v for k, v in vars(ns).items() if k != "json"}, "groups": []}
    for k in ns.adapters:
        group = _group(model, root, ns, prompts, adapters[:k], params)
        print(json.dumps(group), file=sys.stderr)
        report["groups"].append(group)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16], help="adapter counts to mix")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=32, help="generated tokens per request")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=16, help="resident adapter slots (at most the adapter count)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="96MiB", help="per engine (the default holds the whole workload)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the fastest is reported")
    p.add_argument("--model-size", default="small", help="random-weight model shape (pagedserve.bench.random_model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report here")
    ns = p.parse_args(argv)
    if min(ns.adapters) < 1:
        p.error("--adapters: counts must be >= 1")
    if ns.repeats < 1:
        p.error("--repeats: must be >= 1")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = run(ns, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if ns.json is not None:
        ns.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
