"""`pagedserve bench throughput`: offline throughput of a whole workload through `LLM.generate`.

The workload is synthetic (`--num-prompts` requests of `--input-len` / `--output-len` tokens, each a
number or a LOW:HIGH range; `--prefix-len` gives them shared prefixes) or a dataset file (`--dataset`:
JSONL prompts or a ShareGPT JSON file). Every request produces exactly its output length
(`ignore_eos`). `--baseline hf` then runs HF transformers `generate` with static batching on the same
weights, dtype and workload in the same process, at each `--hf-batch-sizes` size (on the whole workload
when it holds at most `--hf-calibration-prompts` requests, else on that many to pick the size that runs
it all), and prints the ratio against the fastest. `--baseline llama-cpp` runs llama.cpp on the same GGUF
file and workload (continuous batching at each `--llama-cpp-batch-sizes` size, `llama_cpp_baseline`), and
with `--llama-cpp-types` also on copies of the file in other GGUF types (e.g. `file,BF16,F32`), the fastest
type and size being the baseline; `--baseline hf,llama-cpp` runs both.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

from pagedserve.bench import common
from pagedserve.bench import report as rep
from pagedserve.bench.roofline import model_facts, run_roofline
from pagedserve.bench.workload import (
    BenchRequest, code_edit, load_dataset, parse_range, synthetic, totals, vocab_token_ids,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput of a workload (optionally against HF generate)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(32, 512), help="N or LOW:HIGH (default 32:512)")
    p.add_argument("--output-len", type=parse_range, default=None,
                   help="N or LOW:HIGH (default 32:256; with --dataset: N overrides the dataset's lengths)")
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens before each prompt")
    p.add_argument("--num-prefixes", type=int, default=8, help="distinct shared prefixes (with --prefix-len)")
    p.add_argument("--dataset", default=None, help="JSONL prompts or a ShareGPT JSON file instead of synthetic")
    p.add_argument("--workload", choices=["random", "repeat"], default="random",
                   help="synthetic prompts of random token ids, or (repeat) code-editing prompts whose output "
                        "re-emits part of the input (what n-gram speculation is for)")
    p.add_argument("--baseline", type=common.parse_baselines, default=[],
                   help="comma-separated: hf (HF generate, static batching) and/or llama-cpp (llama.cpp on the "
                        "same GGUF file, continuous batching) on the same workload; none (default) for neither")
    p.add_argument("--llama-cpp-batch-sizes", default="8,16,32",
                   help="llama.cpp sequences in flight to sweep, each over the whole workload; the fastest is "
                        "the baseline (default 8,16,32)")
    p.add_argument("--llama-cpp-types", default="file",
                   help="comma-separated GGUF types llama.cpp runs the model in: file (the file as it is) and/or "
                        "F32, F16, BF16, Q8_0 (a temporary copy of the file, in TMPDIR, with its weights stored so); every "
                        "type is swept over the batch sizes and the fastest run is the baseline (default file)")
    p.add_argument("--llama-cpp-extra-buffers", action="store_true",
                   help="let llama.cpp use its extra weight buffer types (AMX, repacked layouts); off by default "
                        "(they crashed multi-token calls of llama-cpp-python 0.3.36 on an AMX machine)")
    p.add_argument("--hf-batch-sizes", default="8,16,32,64",
                   help="HF static batch sizes to sweep; the fastest is the baseline (default 8,16,32,64)")
    p.add_argument("--hf-calibration-prompts", type=int, default=32,
                   help="a workload of more requests is swept on its first this many, and the fastest size "
                        "runs it all (default 32)")
    p.add_argument("--host-overhead-batch-sizes", default="64,256",
                   help="after the run, time decode steps at these batch sizes (32-token prompts, 16 output "
                        "tokens) and print each one's host-overhead share ('none' skips it)")
    common.add_engine_args(p)
    common.add_output_args(p)
    p.set_defaults(bench_func=run)


def make_workload(ns: argparse.Namespace, llm: Any) -> list[BenchRequest]:
    tokenizer = llm.get_tokenizer()
    hf_config = llm.llm_engine.config.hf_config
    if ns.dataset:
        if ns.output_len is not None and ns.output_len[0] != ns.output_len[1]:
            raise ValueError("--output-len: with --dataset give one length (N), not a range")
        output_len = ns.output_len[0] if ns.output_len is not None else None
        return load_dataset(ns.dataset, tokenizer, ns.num_prompts, ns.seed, output_len,
                            llm.llm_engine.config.max_model_len)
    if ns.workload == "repeat":
        requests = code_edit(ns.num_prompts, ns.input_len, ns.output_len or (32, 256), ns.seed, tokenizer)
    else:
        ids = vocab_token_ids(tokenizer, hf_config.vocab_size)
        requests = synthetic(ns.num_prompts, ns.input_len, ns.output_len or (32, 256), ns.seed, ids)
    if ns.prefix_len:
        rng = random.Random(ns.seed + 1)
        prefixes = [[rng.choice(ids) for _ in range(ns.prefix_len)] for _ in range(ns.num_prefixes)]
        requests = [BenchRequest(prefixes[i % ns.num_prefixes] + r.prompt_token_ids, r.output_len)
                    for i, r in enumerate(requests)]
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > llm.llm_engine.config.max_model_len:
        raise ValueError(f"--input-len/--output-len/--prefix-len: a request of {longest} tokens exceeds "
                         f"max_model_len {llm.llm_engine.config.max_model_len}")
    return requests


def timed_generate(llm: Any, workload: list[BenchRequest], use_tqdm: bool = True) -> tuple[Any, list, float]:
    """Run `workload` through `llm` greedily at its exact output lengths, after a two-request warm-up and with
    the prefix cache reset (so that the warm-up's prompts give the timed run no hits): the engine's stats
    before the timed run, its outputs and its seconds."""
    from pagedserve.engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    before = llm.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    return before, outputs, time.perf_counter() - start


def host_overhead_batch_sizes(value: str) -> list[int]:
    if value.strip().lower() in ("", "none"):
        return []
    try:
        sizes = [int(v) for v in value.split(",")]
    except ValueError:
        raise ValueError(f"--host-overhead-batch-sizes: expected comma-separated integers or 'none', got {value!r}")
    if any(b < 1 for b in sizes):
        raise ValueError(f"--host-overhead-batch-sizes: batch sizes must be >= 1, got {value!r}")
    return sizes


def decode_host_overhead(llm: Any, batch_sizes: list[int], seed: int) -> dict[str, dict[str, float] | None]:
    """The host's share of a decode step at each batch size: a batch of 32-token prompts is prefilled, then
    its 16 decode steps are timed (the engine's own step and model clocks)."""
    from pagedserve.bench.latency import decode_host_overhead as measure
    from pagedserve.engine.sampling_params import SamplingParams

    ids = vocab_token_ids(llm.get_tokenizer(), llm.llm_engine.config.hf_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    max_num_seqs = llm.llm_engine.config.max_num_seqs
    figures: dict[str, dict[str, float] | None] = {}
    for batch in batch_sizes:
        if batch > max_num_seqs:  # its requests could never all decode in one step
            figures[str(batch)] = None
            continue
        requests = synthetic(batch, (32, 32), (16, 16), seed, ids)
        figures[str(batch)] = measure(llm, [{"prompt_token_ids": r.prompt_token_ids} for r in requests], params)
    return figures


def check_args(ns: argparse.Namespace) -> None:
    common.positive("--num-prompts", ns.num_prompts)
    common.positive("--prefix-len", ns.prefix_len, minimum=0)
    common.positive("--num-prefixes", ns.num_prefixes)
    common.positive("--hf-calibration-prompts", ns.hf_calibration_prompts)
    host_overhead_batch_sizes(ns.host_overhead_batch_sizes)
    if ns.workload == "repeat" and (ns.dataset or ns.prefix_len):
        raise ValueError("--workload: repeat builds its own prompts; leave out --dataset and --prefix-len")


def run(ns: argparse.Namespace) -> int:
    check_args(ns)
    from pagedserve.bench.hf_baseline import hf_baseline, parse_batch_sizes
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.models.loader import resolve_dtype

    candidates = parse_batch_sizes(ns.hf_batch_sizes) if "hf" in ns.baseline else []
    llama_sizes = parse_batch_sizes(ns.llama_cpp_batch_sizes, "--llama-cpp-batch-sizes") if "llama-cpp" in ns.baseline else []
    llama_types: list[str] = []
    if llama_sizes:
        from pagedserve.bench.llama_cpp_baseline import load_bindings, parse_llama_cpp_types

        llama_types = parse_llama_cpp_types(ns.llama_cpp_types)
        load_bindings()  # not installed: say so before pagedserve's run, not after it
    figures = common.machine(ns)
    runs: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    with common.model_path(ns) as model:
        llm = LLM(model=model, dtype=ns.dtype, **common.engine_kwargs(ns))
        try:
            workload = make_workload(ns, llm)
            hf_config = llm.llm_engine.config.hf_config
            max_num_seqs = llm.llm_engine.config.max_num_seqs
            facts = model_facts(model, ns.dtype, hf_config, quantization=ns.quantization or "auto")
            before, outputs, elapsed = timed_generate(llm, workload)
            stats = llm.get_stats()
            host = common.host_overhead(before, stats)
            spec = common.spec_decode_delta(before, stats)
            decode_host = decode_host_overhead(llm, host_overhead_batch_sizes(ns.host_overhead_batch_sizes), ns.seed)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
        prompt_tokens, output_tokens = totals(workload)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        failed = sum(1 for o in outputs if o.error)
        if produced != output_tokens and not failed:
            raise RuntimeError(f"produced {produced} output tokens, the workload asks for {output_tokens}")
        ours: dict[str, Any] = {
            "name": "pagedserve", "params": {"engine": "pagedserve", "max_num_seqs": max_num_seqs},
            "num_requests": len(workload), "completed": len(workload) - failed, "failed": failed,
            "prompt_tokens": prompt_tokens, "output_tokens": produced, "duration_s": elapsed,
            "throughput": rep.throughput(len(workload), prompt_tokens, produced, elapsed),
            "latency_ms": {"e2e": rep.summarize(o.metrics.finished_time - o.metrics.arrival_time for o in outputs
                                                if o.metrics and o.metrics.finished_time),
                           "ttft": rep.summarize(o.metrics.time_to_first_token for o in outputs
                                                 if o.metrics and o.metrics.first_token_time)},
            "roofline": {},
        }
        if host is not None:
            ours["host_overhead"] = host
        if spec is not None:
            ours["spec_decode"] = spec
        lengths = [(len(r.prompt_token_ids), r.output_len) for r in workload]
        if figures is not None and host is not None:  # the engine's own step count and host share
            ours["roofline"]["run"] = run_roofline(facts, figures, lengths, host["steps"], elapsed,
                                                   host_share=host["host_share"]).to_dict()
        runs.append(ours)
        summary.update(prefix_cache_hit_rate=stats.prefix_cache_hit_rate if stats.prefix_cache_queries else None,
                       preemptions=stats.num_preemptions, model_dtype=facts.dtype)
        if decode_host:
            summary["decode_host_overhead"] = decode_host
        if "hf" in ns.baseline:
            torch_dtype = resolve_dtype(ns.dtype, hf_config, "cpu")
            pad = int(getattr(hf_config, "pad_token_id", None) or 0)
            hf = hf_baseline(model, torch_dtype, workload, candidates, ns.hf_calibration_prompts, pad)
            runs.append({
                "name": f"HF generate (batch {hf.batch_size})", "params": {"engine": "hf", "batch_size": hf.batch_size},
                "num_requests": len(workload), "completed": len(workload), "failed": 0,
                "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "duration_s": hf.seconds,
                "throughput": rep.throughput(len(workload), prompt_tokens, output_tokens, hf.seconds),
                "latency_ms": {}, "roofline": {},
            })
            if figures is not None:  # HF's forward passes; its host share is not measured
                runs[-1]["roofline"]["run"] = run_roofline(facts, figures, lengths, hf.steps, hf.seconds).to_dict()
            summary["hf_out_tok_s_by_batch_size"] = {str(bs): rate for bs, rate in hf.rates.items()}
            summary["hf_batch_size"] = hf.batch_size
            summary["hf_swept_on"] = ("the whole workload" if hf.swept_whole_workload
                                      else f"the first {ns.hf_calibration_prompts} requests")
            summary["ratio_output_tokens_per_s"] = (ours["throughput"]["output_tokens_per_s"]
                                                    / runs[-1]["throughput"]["output_tokens_per_s"])
        if llama_sizes:
            from pagedserve.bench.llama_cpp_baseline import llama_cpp_baseline

            best, rates = llama_cpp_baseline(model, workload, llama_sizes, ns.cpu_threads,
                                             extra_buffers=ns.llama_cpp_extra_buffers, types=llama_types)
            runs.append({
                "name": f"llama.cpp ({best.gguf_type}, batch {best.batch_size})",
                "params": {"engine": "llama-cpp", "batch_size": best.batch_size, "gguf_type": best.gguf_type},
                "num_requests": len(workload), "completed": len(workload), "failed": 0,
                "prompt_tokens": prompt_tokens, "output_tokens": best.output_tokens, "duration_s": best.seconds,
                "throughput": rep.throughput(len(workload), prompt_tokens, best.output_tokens, best.seconds),
                "latency_ms": {"ttft": rep.summarize(best.first_token_times)}, "roofline": {},
            })
            summary["llama_cpp_out_tok_s_by_batch_size"] = {str(bs): rate for bs, rate in rates[best.gguf_type].items()}
            summary["llama_cpp_out_tok_s_by_type"] = {kind: {str(bs): rate for bs, rate in by_size.items()}
                                                      for kind, by_size in rates.items()}
            summary["ratio_vs_llama_cpp_output_tokens_per_s"] = (ours["throughput"]["output_tokens_per_s"]
                                                                 / runs[-1]["throughput"]["output_tokens_per_s"])
    label = model if ns.random_weights is None else f"random-{ns.random_weights}"
    report = rep.make_report("throughput", label, {k: v for k, v in vars(ns).items() if k != "bench_func"}, runs,
                             figures.to_dict() if figures else None, summary)
    rows = [[r["name"], r["num_requests"], r["prompt_tokens"], r["output_tokens"], r["duration_s"],
             r["throughput"]["requests_per_s"], r["throughput"]["output_tokens_per_s"],
             r["throughput"]["total_tokens_per_s"]] for r in runs]
    parts = [f"pagedserve bench throughput: {label} ({facts.dtype}), {ns.dataset or ns.workload} workload"
             + (f", speculative {ns.speculative_config}" if ns.speculative_config else ""),
             rep.table(["engine", "requests", "prompt tok", "output tok", "seconds", "req/s", "out tok/s",
                        "total tok/s"], rows)]
    if "ratio_output_tokens_per_s" in summary:
        swept = ", ".join(f"batch {bs}: {rate:.1f}" for bs, rate in summary["hf_out_tok_s_by_batch_size"].items())
        parts.append(f"HF generate output tok/s by batch size, on {summary['hf_swept_on']}: {swept}\n"
                     f"pagedserve / HF (batch {summary['hf_batch_size']}, its fastest) output tok/s: "
                     f"{summary['ratio_output_tokens_per_s']:.2f}x")
    if "ratio_vs_llama_cpp_output_tokens_per_s" in summary:
        swept = "; ".join(f"{kind}: " + ", ".join(f"batch {bs}: {rate:.1f}" for bs, rate in by_size.items())
                          for kind, by_size in summary["llama_cpp_out_tok_s_by_type"].items())
        parts.append(f"llama.cpp output tok/s by GGUF type and batch size (whole workload): {swept}\n"
                     f"pagedserve / llama.cpp (its fastest) output tok/s: "
                     f"{summary['ratio_vs_llama_cpp_output_tokens_per_s']:.2f}x")
    if ns.speculative_config:
        parts.append(common.spec_decode_line(spec, ns.speculative_config))
    parts.append(common.host_overhead_line(host, "pagedserve's engine steps (whole run)"))
    parts += [common.host_overhead_line(f, f"a decode step at batch {b}") for b, f in decode_host.items()]
    parts += [rep.machine_line(report["machine"]), rep.roofline_table(runs)]
    common.finish(report, ns, "\n\n".join(parts))
    return 0
