"""The KV offload tier on a working set larger than the device cache: hit rate and throughput with and without
the tier, on the same engine shape in one process (a random-weight model: nothing to download).

Many tenants, each with a long system context and short follow-up questions, visited round-robin: the contexts
together need more KV than the device cache holds, so without a tier every visit finds its context evicted and
recomputes it; with one, the evicted context is reloaded from host shared memory.

    python benchmarks/kv_offload.py [--tenants 8 --context 512 --rounds 3 --device-blocks 96 --json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.bench.random_model import make_random_model
from pagedserve.engine import LLM, SamplingParams


def _workload(ns: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(ns.seed)
    contexts = [[rng.randrange(3, 32000) for _ in range(ns.context)] for _ in range(ns.tenants)]
    return [ctx + [rng.randrange(3, 32000) for _ in range(ns.question)] for _ in range(ns.rounds) for ctx in contexts]


def _run(model: Path, prompts: list[list[int]], ns: argparse.Namespace, offload: str | None) -> dict:
    kwargs = dict(model=str(model), dtype="float32", block_size=16, num_kv_blocks=ns.device_blocks,
                  max_num_seqs=ns.concurrency, max_num_batched_tokens=2048, seed=ns.seed)
    if offload is not None:
        kwargs["kv_offload_size"] = offload
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=ns.output, temperature=0, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up (counted out below)
        before = llm.get_stats()
        started = time.perf_counter()
        outputs = []
        for i in range(0, len(prompts), ns.concurrency):  # requests arrive `concurrency` at a time
            outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + ns.concurrency]], params,
                                    use_tqdm=False)
        seconds = time.perf_counter() - started
        stats = llm.get_stats()
        tier = stats.kv_offload
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        device_hits = stats.prefix_cache_hits - before.prefix_cache_hits
        tier_hits = stats.kv_offload_hit_tokens - before.kv_offload_hit_tokens
        out = {
            "tier": offload or "none",
            "requests": len(prompts),
            "seconds": round(seconds, 3),
            "output_tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, 2),
            "requests_per_s": round(len(prompts) / seconds, 3),
            "prompt_tokens": queries,
            "device_hit_rate": round(device_hits / queries, 4) if queries else 0.0,
            "tier_hit_tokens": tier_hits,
            "hit_rate": round((device_hits + tier_hits) / queries, 4) if queries else 0.0,
            "cached_tokens_per_request": round(sum(o.num_cached_tokens for o in outputs) / len(outputs), 1),
            "tokens": [o.outputs[0].token_ids for o in outputs],
        }
        if tier:
            rank = llm.llm_engine.engine_core.kv_offload_state()["ranks"][0]["stats"]
            out.update(stored_mib=round(tier["stored_bytes"] / 2**20, 2), loaded_mib=round(tier["loaded_bytes"] / 2**20, 2),
                       load_seconds=round(tier["load_seconds"], 3), spill_copy_seconds=round(rank["stage_seconds"], 4),
                       spill_copy_share_of_run=round(rank["stage_seconds"] / seconds, 5))
        return out
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--context", type=int, default=512, help="system-context tokens per tenant")
    p.add_argument("--question", type=int, default=16, help="follow-up tokens per request")
    p.add_argument("--output", type=int, default=8, help="generated tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--device-blocks", type=int, default=96, help="device KV cache blocks of 16 tokens")
    p.add_argument("--offload-size", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report here")
    ns = p.parse_args(argv)
    prompts = _workload(ns)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_model("small", Path(tmp), dtype="float32", seed=ns.seed)
        without = _run(model, prompts, ns, None)
        with_tier = _run(model, prompts, ns, ns.offload_size)
    same = without.pop("tokens") == with_tier.pop("tokens")
    working_set = ns.tenants * (ns.context + ns.question + ns.output)
    report = {
        "workload": {**{k: v for k, v in vars(ns).items() if k != "json"},
                     "working_set_tokens": working_set, "device_cache_tokens": ns.device_blocks * 16},
        "without_tier": without, "with_tier": with_tier, "same_greedy_tokens": same,
        "hit_rate_ratio": round(with_tier["hit_rate"] / without["hit_rate"], 2) if without["hit_rate"] else None,
        "throughput_ratio": round(with_tier["output_tokens_per_s"] / without["output_tokens_per_s"], 2),
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if ns.json is not None:
        ns.json.write_text(text + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
