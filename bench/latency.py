"""`pagedserve bench latency`: the end-to-end latency of one batch, and its split into prefill and decode.

Each iteration sends the same `--batch-size` prompts of `--input-len` random tokens (prefix cache reset
first, so nothing is reused) with `--output-len` tokens each (`ignore_eos`) and times the whole batch.
The engine's own request metrics split it: prefill = until the last request of the batch has its first
token; decode per token = the rest over the remaining `output_len - 1` steps. `--baseline llama-cpp`
times llama.cpp on the same GGUF file and batch the same way (`llama_cpp_baseline`: all `--batch-size`
sequences in one context) and prints the ratios; with `--llama-cpp-types` also on copies of the file in
other GGUF types, each its own row, the ratios taken against the type with the fastest decode.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tqdm.auto import tqdm

from pagedserve.bench import common
from pagedserve.bench import report as rep
from pagedserve.bench.roofline import model_facts, step_roofline
from pagedserve.bench.workload import code_edit, synthetic, vocab_token_ids


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="end-to-end latency of one batch (prefill + per-token decode)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--workload", choices=["random", "repeat"], default="random",
                   help="random: random token ids; repeat: code-editing prompts whose output re-emits part of "
                        "the input (what n-gram speculation is for)")
    p.add_argument("--baseline", choices=["none", "llama-cpp"], default="none",
                   help="llama-cpp: also time llama.cpp on the same GGUF file and batch")
    p.add_argument("--llama-cpp-types", default="file",
                   help="comma-separated GGUF types llama.cpp runs the model in: file (the file as it is) and/or "
                        "F32, F16, BF16, Q8_0 (a temporary copy stored so, in TMPDIR); the ratios are against the type with "
                        "the fastest median decode per token (default file)")
    p.add_argument("--llama-cpp-extra-buffers", action="store_true",
                   help="let llama.cpp use its extra weight buffer types (AMX, repacked layouts); off by default")
    common.add_engine_args(p)
    common.add_output_args(p)
    p.set_defaults(bench_func=run)


def llama_cpp_latency(model: str, batch: list, num_iters: int, num_warmup: int, n_threads: int | None,
                      extra_buffers: bool = False, types: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """llama.cpp's e2e, prefill (until every sequence has its first token) and decode-per-token times of
    the batch, over `num_iters` runs on one context (after `num_warmup`), in the latency table's shape:
    one entry per GGUF type run (the file's own, and each of `types`), in order."""
    from pagedserve.bench.llama_cpp_baseline import FILE_AS_IS, LlamaCppEngine, gguf_file_of, gguf_variants

    longest = max(len(r.prompt_token_ids) + r.output_len for r in batch)
    by_type: dict[str, dict[str, dict[str, float]]] = {}
    variants = gguf_variants(gguf_file_of(model), types or [FILE_AS_IS])
    try:
        for kind, path in variants:
            engine = LlamaCppEngine(path, len(batch), longest, n_threads, extra_buffers=extra_buffers)
            e2e, prefill, decode = [], [], []
            try:
                for _ in range(num_warmup):
                    engine.run(batch)
                for _ in tqdm(range(num_iters), desc=f"llama.cpp ({kind}) iterations"):
                    result = engine.run(batch)
                    first, last = max(result.first_token_times), max(result.finish_times)
                    e2e.append(result.seconds)
                    prefill.append(first)
                    steps = batch[0].output_len - 1
                    if steps > 0:
                        decode.append((last - first) / steps)
            finally:
                engine.close()
            by_type[kind] = {"e2e": rep.summarize(e2e), "prefill": rep.summarize(prefill),
                             "decode_per_token": rep.summarize(decode)}
    finally:
        variants.close()
    return by_type


def fastest_type(by_type: dict[str, dict[str, dict[str, float]]]) -> str:
    """The GGUF type with the lowest median decode per token (e2e where the batch decodes no step)."""
    def key(kind: str) -> float:
        stats = by_type[kind]
        return (stats.get("decode_per_token") or {}).get("p50") or stats["e2e"]["p50"]
    return min(by_type, key=key)


def check_args(ns: argparse.Namespace) -> None:
    common.positive("--input-len", ns.input_len)
    common.positive("--output-len", ns.output_len)
    common.positive("--batch-size", ns.batch_size)
    common.positive("--num-iters", ns.num_iters)
    common.positive("--num-iters-warmup", ns.num_iters_warmup, minimum=0)


def _iteration(llm: Any, prompts: list[dict], params: Any) -> tuple[float, float, float | None]:
    """(e2e, prefill, decode per token) seconds of one batch."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    e2e = time.perf_counter() - start
    for out in outputs:
        if len(out.outputs[0].token_ids) != params.max_tokens:
            raise RuntimeError(f"request {out.request_id} produced {len(out.outputs[0].token_ids)} tokens, "
                               f"expected {params.max_tokens} (error: {out.error})")
    metrics = [o.metrics for o in outputs]
    arrival = min(m.arrival_time for m in metrics)
    first = max(m.first_token_time for m in metrics)
    last = max(m.finished_time or m.last_token_time for m in metrics)
    prefill = first - arrival
    decode = (last - first) / (params.max_tokens - 1) if params.max_tokens > 1 else None
    return e2e, prefill, decode


def host_overheads(llm: Any, prompts: list[dict], params: Any) -> tuple[dict[str, float] | None,
                                                                        dict[str, float] | None]:
    """The host's share of the batch's prefill steps (until every request has its first token) and of
    the decode steps that follow, each timed by the engine's own clocks."""
    from pagedserve.engine.output_processor import OutputKind

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    waiting = {f"host-overhead-{i}" for i in range(len(prompts))}
    start = engine.get_stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"host-overhead-{i}", prompt, params, output_kind=OutputKind.DELTA)
    while waiting and engine.has_unfinished_requests():
        for out in engine.step():
            waiting.discard(out.request_id)
    before = engine.get_stats()
    while engine.has_unfinished_requests():
        engine.step()
    return common.host_overhead(start, before), common.host_overhead(before, engine.get_stats())


def decode_host_overhead(llm: Any, prompts: list[dict], params: Any) -> dict[str, float] | None:
    """The host's share of the batch's decode steps, after its prefill (`host_overheads`)."""
    return host_overheads(llm, prompts, params)[1]


def run(ns: argparse.Namespace) -> int:
    check_args(ns)
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    llama_types: list[str] = []
    if ns.baseline == "llama-cpp":
        from pagedserve.bench.llama_cpp_baseline import load_bindings, parse_llama_cpp_types

        llama_types = parse_llama_cpp_types(ns.llama_cpp_types)
        load_bindings()  # not installed: say so before pagedserve's run, not after it
    figures = common.machine(ns)
    kwargs = common.engine_kwargs(ns)
    kwargs.setdefault("max_num_seqs", max(ns.batch_size, 1))
    with common.model_path(ns) as model:
        llm = LLM(model=model, dtype=ns.dtype, **kwargs)
        try:
            if ns.workload == "repeat":
                batch = code_edit(ns.batch_size, (ns.input_len,) * 2, (ns.output_len,) * 2, ns.seed,
                                  llm.get_tokenizer())
            else:
                ids = vocab_token_ids(llm.get_tokenizer(), llm.llm_engine.config.hf_config.vocab_size)
                batch = synthetic(ns.batch_size, (ns.input_len,) * 2, (ns.output_len,) * 2, ns.seed, ids)
            prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
            params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
            for _ in tqdm(range(ns.num_iters_warmup), desc="warm-up", leave=False):
                _iteration(llm, prompts, params)
            before = llm.get_stats()
            times = [_iteration(llm, prompts, params) for _ in tqdm(range(ns.num_iters), desc="iterations")]
            spec = common.spec_decode_delta(before, llm.get_stats())
            prefill_host, host = host_overheads(llm, prompts, params)
            facts = model_facts(model, ns.dtype, llm.llm_engine.config.hf_config, quantization=ns.quantization or "auto")
        finally:
            llm.shutdown()
        baselines = (llama_cpp_latency(model, batch, ns.num_iters, ns.num_iters_warmup, ns.cpu_threads,
                                       ns.llama_cpp_extra_buffers, llama_types)
                     if ns.baseline == "llama-cpp" else {})
    e2e = [t[0] for t in times]
    prefill = [t[1] for t in times]
    decode = [t[2] for t in times if t[2] is not None]
    duration = sum(e2e)
    n = ns.batch_size * ns.num_iters
    prompt_tokens, output_tokens = n * ns.input_len, n * ns.output_len
    run_entry: dict[str, Any] = {
        "name": f"batch {ns.batch_size} x ({ns.input_len} in, {ns.output_len} out)",
        "params": {"batch_size": ns.batch_size, "input_len": ns.input_len, "output_len": ns.output_len,
                   "num_iters": ns.num_iters},
        "num_requests": n, "completed": n, "failed": 0, "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens, "duration_s": duration,
        "throughput": rep.throughput(n, prompt_tokens, output_tokens, duration),
        "latency_ms": {"e2e": rep.summarize(e2e), "prefill": rep.summarize(prefill),
                       "decode_per_token": rep.summarize(decode)},
        "roofline": {},
    }
    if host is not None:
        run_entry["host_overhead"] = host
    if spec is not None:
        run_entry["spec_decode"] = spec
    if figures is not None:
        n_in, b = ns.input_len, ns.batch_size
        prefill_mean = sum(prefill) / len(prefill)
        run_entry["roofline"]["prefill"] = step_roofline(
            facts, figures, tokens=b * n_in, context_tokens=b * n_in, measured_s=prefill_mean,
            attention_pairs=b * n_in * (n_in + 1) // 2,
            host_share=prefill_host["host_share"] if prefill_host else None).to_dict()
        if decode:
            context = b * (n_in + ns.output_len // 2)  # the mean context over the decode steps
            run_entry["roofline"]["decode"] = step_roofline(
                facts, figures, tokens=b, context_tokens=context, measured_s=sum(decode) / len(decode),
                host_share=host["host_share"] if host else None).to_dict()
    runs = [run_entry]
    ratios = None
    for kind, stats in baselines.items():
        runs.append({**run_entry, "name": f"llama.cpp ({kind}), {run_entry['name']}",
                     "params": {**run_entry["params"], "engine": "llama-cpp", "gguf_type": kind},
                     "latency_ms": stats, "roofline": {}, "duration_s": stats["e2e"]["mean"] / 1000 * ns.num_iters,
                     "throughput": rep.throughput(n, prompt_tokens, output_tokens,
                                                  stats["e2e"]["mean"] / 1000 * ns.num_iters)})
    best_type = fastest_type(baselines) if baselines else None
    if best_type is not None:
        baseline = baselines[best_type]
        ratios = {key: baseline[key]["p50"] / run_entry["latency_ms"][key]["p50"]
                  for key in ("e2e", "prefill", "decode_per_token")
                  if (run_entry["latency_ms"].get(key) or {}).get("p50") and (baseline.get(key) or {}).get("p50")}
    report = rep.make_report("latency", model if ns.random_weights is None else f"random-{ns.random_weights}",
                             {k: v for k, v in vars(ns).items() if k != "bench_func"}, runs,
                             figures.to_dict() if figures else None,
                             {"e2e_mean_ms": run_entry["latency_ms"]["e2e"]["mean"],
                              "model_dtype": facts.dtype,
                              **({"llama_cpp_over_pagedserve_median_time": ratios,
                                  "llama_cpp_gguf_type": best_type} if ratios else {})})
    parts = [f"pagedserve bench latency: {run_entry['name']}, {ns.workload} workload, {ns.num_iters} iterations"
             + (f", speculative {ns.speculative_config}" if ns.speculative_config else ""),
             *[f"{r['name']}\n" + rep.latency_table(r) for r in runs],
             None if not ratios else f"llama.cpp ({best_type}) time / pagedserve time (median; above 1: pagedserve faster): "
             + ", ".join(f"{key} {value:.2f}x" for key, value in ratios.items()),
             common.spec_decode_line(spec, ns.speculative_config),
             common.host_overhead_line(host, f"a decode step at batch {ns.batch_size}"),
             rep.machine_line(report["machine"]),
             rep.roofline_table([run_entry])]
    text = "\n\n".join(part for part in parts if part is not None)
    common.finish(report, ns, text)
    return 0
