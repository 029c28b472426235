"""Structured output cost: the bundled default model serving 64 concurrent JSON-schema requests
against the same 64 requests unconstrained, in one run, plus the grammar compile time with and
without the compile cache.

    python benchmarks/structured_output.py [--num-requests 64] [--max-tokens 96] [--rounds 2]

Both workloads use the same prompts, seeds and sampling settings. A constrained request stops when
its JSON is complete; so that both runs do the same work, each unconstrained request then generates
exactly as many tokens as its constrained twin did (max_tokens = that count, ignore_eos), and the
slowdown is the ratio of wall times (equivalently of tokens per second). Rounds alternate
constrained / unconstrained so load from other processes on a shared machine hits both alike; the
best round of each is reported, with the median of the per-round ratios. Because a shared machine's
load swings between rounds, the time spent in the grammar work itself (filling bitmasks, applying
them, advancing matchers) is also measured inside the constrained runs, as a share of their wall
time: that share is the overhead with the noise of the forward pass taken out. Compile times: "cold" clears
the engine's cache (and xgrammar's) and compiles the schema again; "cached" is a cache hit. The
one-time tokenizer-info build is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.structured_output import StructuredOutputsParams, bitmask  # noqa: E402
from pagedserve.engine.structured_output import manager as manager_module  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default-model"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
}
TOPICS = ["a teacher", "a cyclist", "a chef", "a pilot", "a gardener", "a painter", "a doctor", "a student"]


def run_once(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[int], int]:
    """(seconds, generated tokens per request, requests that finished with 'stop')."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    stopped = sum(c.finish_reason == "stop" for o in outs for c in o.outputs)
    return elapsed, lengths, stopped


class GrammarTimer:
    """Accumulates the seconds spent filling bitmasks, applying them and advancing matchers."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.on = False

    def wrap(self, owner: object, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def compile_times(llm: LLM, repeats: int) -> dict[str, float]:
    manager = llm.llm_engine.engine_core.structured_output()
    start = time.perf_counter()
    manager.start()  # the tokenizer info and the compile workers, once per engine
    setup = time.perf_counter() - start
    spec = StructuredOutputsParams(json=SCHEMA)
    cold, cached = [], []
    for _ in range(repeats):
        manager.clear_cache()
        start = time.perf_counter()
        manager.submit(spec).result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.submit(spec).result()
        cached.append(time.perf_counter() - start)
    return {"tokenizer_info_ms": 1000 * setup, "cold_ms": 1000 * statistics.median(cold),
            "cached_ms": 1000 * statistics.median(cached)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile-repeats", type=int, default=5)
    args = parser.parse_args()

    timer = GrammarTimer()
    timer.wrap(manager_module.StructuredOutputManager, "fill_bitmask")
    timer.wrap(manager_module.StructuredOutputRequest, "accept")
    timer.wrap(bitmask, "apply_token_bitmask")
    llm = LLM(model=args.model, max_num_seqs=args.num_requests)
    prompts = [f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as a JSON object:" for i in range(args.num_requests)]
    base = dict(temperature=0.7, top_p=0.95)
    constrained = [SamplingParams(seed=i, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA}, **base)
                   for i in range(args.num_requests)]

    compile_stats = compile_times(llm, args.compile_repeats)
    # Warm-up: first-step costs out of the figures.
    run_once(llm, prompts[:4], constrained[:4])
    run_once(llm, prompts[:4], [SamplingParams(seed=i, max_tokens=8, **base) for i in range(4)])
    results: dict[str, list[tuple[float, list[int], int]]] = {"json_schema": [], "unconstrained": []}
    for _ in range(args.rounds):
        timer.on = True
        results["json_schema"].append(run_once(llm, prompts, constrained))
        timer.on = False
        lengths = results["json_schema"][-1][1]
        plain = [SamplingParams(seed=i, max_tokens=n, ignore_eos=True, **base) for i, n in enumerate(lengths)]
        results["unconstrained"].append(run_once(llm, prompts, plain))
    manager = llm.llm_engine.engine_core.structured_output()
    summary: dict[str, dict[str, float]] = {}
    for name, rounds in results.items():
        best = max(rounds, key=lambda r: sum(r[1]) / r[0])
        elapsed, lengths, stopped = best
        tokens = sum(lengths)
        summary[name] = {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
                         "ms_per_output_token_per_seq": 1000 * elapsed / max(1, tokens / args.num_requests),
                         "finished_stop": stopped}
    llm.shutdown()

    slowdown = summary["unconstrained"]["tokens_per_s"] / summary["json_schema"]["tokens_per_s"]
    ratios = [c[0] / u[0] for c, u in zip(results["json_schema"], results["unconstrained"])]
    grammar_share = timer.seconds / sum(r[0] for r in results["json_schema"])
    print(f"model: {args.model}  requests: {args.num_requests}  max_tokens: {args.max_tokens}")
    for name, s in summary.items():
        print(f"  {name:14s} {s['tokens']:6d} tokens in {s['seconds']:6.2f} s = {s['tokens_per_s']:8.1f} tok/s "
              f"({s['finished_stop']}/{args.num_requests} finished 'stop')")
    print(f"  slowdown (unconstrained tok/s / json_schema tok/s): best rounds {slowdown:.3f}x, "
          f"median of per-round ratios {statistics.median(ratios):.3f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  grammar work (fill + apply + accept) in the constrained runs: {timer.seconds:.2f} s, "
          f"{100 * grammar_share:.1f}% of their wall time")
    print(f"  grammar compile: cold {compile_stats['cold_ms']:.2f} ms, cached {compile_stats['cached_ms']:.3f} ms "
          f"(tokenizer info + compile workers, once per engine: {compile_stats['tokenizer_info_ms']:.1f} ms); "
          f"engine cache: {manager.num_compiles} compiles, {manager.num_cache_hits} hits")
    print(json.dumps({"summary": summary, "slowdown": slowdown, "round_ratios": ratios,
                      "grammar_work_share": grammar_share, "compile": compile_stats}))


if __name__ == "__main__":
    main()
