"""`pagedserve bench serve`: a server under load, at one or several request rates.

Against `--base-url`, or a server it starts itself for MODEL (`--start-server`: loopback only, shut down
at the end). Requests arrive as a Poisson process at each `--request-rate` (inf: all at once, a burst),
at most `--max-concurrency` in flight; TTFT, TPOT, ITL and e2e come out as mean / p50 / p90 / p99.
With `--slo ttft:500ms,tpot:50ms` each rate also gets its goodput (requests/s meeting every target)
and the sweep the highest rate that meets it; `--plot` draws latency against load over the rates.

`--pd` (with `--start-server`) starts the prefill/decode app instead of the monolithic one:
`--num-prefill-engines` prefill and `--num-decode-engines` decode replicas (default 1 + 1), KV over
`--kv-connector`. `--routing-overhead N` (with `--start-server`) also times N one-token requests through
the shape's Serve handle against the in-process coordinator (`routing_overhead`); run it with and
without `--pd` to compare the shapes.

Before the first rate, `--num-warmups` requests (default 2, as `bench throughput` warms its engine) go out
and count nowhere (`warm_up`): a fresh server's first requests pay one-off costs that would otherwise land
in the first rate's figures.

The roofline of a rate's decode step: by Little's law the mean number of sequences decoding at once
is output tokens/s x mean TPOT; each step is one such batch at the mean context (prompt + half the
output), measured as the mean TPOT.

`--workload shared-prefix` sends many tenants' requests, each tenant a long system context
(`--context-len`) and `--questions` short follow-ups (`--question-len`), the tenants interleaved round by
round (bench/workload.SharedPrefixShape); with `--start-server` each engine's KV cache is sized so that
the contexts need `--kv-demand-ratio` (default 2) times one engine's cache. `--compare-routing all` (with
`--start-server` and one rate) runs it once per routing policy on the same engine settings (random,
power_of_two, prefix_approx, exact, exact+offload: bench/routing_compare.py) and reports TTFT p50/p90,
output throughput and the prefix hit rate of each.

`--offline-baseline` (with `--start-server`, one engine) first runs the same workload through an offline
engine (`LLM`, `bench throughput`'s timed run) with the server's engine settings, before the server
starts so that nothing of it runs beside the offline engine, and reports each rate's output throughput as
a ratio of the offline one: what serving costs on this machine, measured in one command.

`--chaos-kill-every S` runs every rate a second time while an engine replica is killed every S
seconds (bench/chaos.py) and reports both side by side: goodput, p99 TTFT/TPOT, the longest stall a
stream saw, and each kill's migration cost (from the kill to the first token after the seam).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from pagedserve.bench import chaos, common, routing_compare
from pagedserve.bench import report as rep
from pagedserve.bench.local_server import LocalServer
from pagedserve.bench.loadgen import LoadRun, ServerInfo, run_load, server_info, warm_up
from pagedserve.bench.offline_baseline import offline_baseline
from pagedserve.bench.overhead_split import overhead_delta, overhead_table, scrape
from pagedserve.bench.roofline import Machine, ModelFacts, step_roofline
from pagedserve.bench.slo import goodput, max_rate_meeting_slo, parse_slo, rate_label
from pagedserve.bench.workload import (
    BenchRequest, SharedPrefixShape, parse_range, shared_prefix, synthetic, vocab_token_ids,
)
from pagedserve.cluster.cli import stream_interval_arg


def parse_rates(text: str) -> list[float]:
    try:
        rates = [math.inf if r.strip() in ("inf", "") else float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (or inf), got {text!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError("request rates must be > 0 (or inf)")
    return rates


def add_load_args(p: argparse.ArgumentParser, num_prompts: int = 100) -> None:
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                   help="requests/s (Poisson); comma-separated for a sweep; inf = all at once (a burst)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=parse_range, default=(32, 128), help="N or LOW:HIGH")
    p.add_argument("--output-len", type=parse_range, default=(16, 64), help="N or LOW:HIGH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=2, metavar="N",
                   help="requests sent before each server's timed runs and not counted (default 2, as `bench "
                        "throughput` warms its engine; 0: none): the server's first-use costs stay out of the figures")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may wait on a silent connection or stream before it counts as failed")
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet --slo for a rate to count as meeting it")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server (with --start-server / tune)")
    g.add_argument("--port", type=int, default=None, help="(default: a free one; always on 127.0.0.1)")
    # bench throughput's budget: 256 MiB held 11.6k tokens of the default model, under the 14k that the issue's
    # 64 requests (prompts 32-256, outputs 32-128) reach at once, so the served engine queued what offline ran.
    g.add_argument("--kv-cache-memory", default=common.DEFAULT_KV_CACHE_MEMORY,
                   help=f"each engine's KV cache budget on CPU (default {common.DEFAULT_KV_CACHE_MEMORY}, "
                        "as bench throughput)")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--num-cpus-per-engine", type=float, default=None,
                   help="CPUs each engine replica reserves in Ray, then its torch threads unless --cpu-threads "
                        "(default: 1 reserved, and the node's CPUs shared by the engines as threads)")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads of each engine (default: see --num-cpus-per-engine; a lone engine uses "
                        "every core, as bench throughput's does)")
    g.add_argument("--quantization", "-q", choices=["auto", "gguf", "none", "int8", "int4"], default=None,
                   help="the engines' weight quantization, as `bench throughput --quantization`")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None, help="engine replicas (default 1)")
    g.add_argument("--stream-interval", type=stream_interval_arg, default=None, metavar="N|auto",
                   help="the server's stream interval: one SSE event per N generated tokens (default: the "
                        "server's, auto: 1 under light load, more under heavy load); the ITL figures are the gaps "
                        "between events")
    g.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                   help="the started server's ingress listens on its port itself (default: as `pagedserve serve`, "
                        "where it can); --no-direct-ingress: through Serve's proxy")
    g.add_argument("--pd", action="store_true", help="start the prefill/decode app (two Serve deployments)")
    g.add_argument("--num-prefill-engines", type=int, default=1, help="prefill replicas with --pd (default 1)")
    g.add_argument("--num-decode-engines", type=int, default=1, help="decode replicas with --pd (default 1)")
    g.add_argument("--kv-connector", default="ray", choices=["ray", "torch_p2p"], help="KV transport with --pd")
    g.add_argument("--routing-overhead", type=int, default=0, metavar="N",
                   help="also time N one-token requests through the Serve handle and in-process")
    g.add_argument("--routing-policy", default=None, choices=list(routing_compare.POLICY_RUNS)[:4],
                   help="the engine router's policy (default exact)")
    g.add_argument("--kv-offload-size", default=None,
                   help="a KV offload tier per engine, e.g. 256MiB (with --compare-routing: the exact+offload arm's; "
                        "default 256MiB there)")


def add_shared_prefix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-tenant shared-prefix workload (--workload shared-prefix)")
    g.add_argument("--workload", choices=["random", "shared-prefix"], default="random",
                   help="random prompts (--input-len), or tenants with long shared contexts and short questions")
    g.add_argument("--tenants", type=int, default=16, help="tenants, each with its own system context")
    g.add_argument("--context-len", type=int, default=512, help="tokens of each tenant's system context")
    g.add_argument("--questions", type=int, default=4, help="follow-up questions per tenant (its requests)")
    g.add_argument("--question-len", type=int, default=16, help="tokens of each question, after the context")
    g.add_argument("--kv-demand-ratio", type=float, default=2.0,
                   help="with --start-server: size each engine's KV cache so that the contexts need this many "
                        "times it (default 2)")
    g.add_argument("--compare-routing", type=routing_compare.parse_policies, default=None, metavar="POLICIES",
                   help="with --start-server: run the workload once per routing policy, one app each: all, or "
                        f"a comma-separated list of {', '.join(routing_compare.POLICY_RUNS)} (default -dp 2)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test a server (or one it starts) at one or several request rates",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p, random_weights=False)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--start-server", action="store_true", help="start a local server for MODEL first")
    p.add_argument("--slo", default=None, help="latency targets, e.g. ttft:500ms,tpot:50ms (goodput)")
    p.add_argument("--offline-baseline", action="store_true",
                   help="with --start-server: first run the workload through an offline engine with the same "
                        "engine settings and report each rate's output throughput as a ratio of it")
    add_load_args(p)
    add_server_args(p)
    add_shared_prefix_args(p)
    chaos.add_chaos_args(p)
    common.add_output_args(p, plot=True)
    p.set_defaults(bench_func=run)


def check_load_args(ns: argparse.Namespace) -> dict[str, float] | None:
    common.positive("--num-prompts", ns.num_prompts)
    common.positive("--num-warmups", ns.num_warmups, minimum=0)
    if ns.max_concurrency is not None:
        common.positive("--max-concurrency", ns.max_concurrency)
    if not ns.timeout > 0:
        raise ValueError(f"--timeout: must be > 0, got {ns.timeout}")
    if not 0 < ns.slo_attainment <= 1:
        raise ValueError(f"--slo-attainment: must be in (0, 1], got {ns.slo_attainment}")
    pd, overhead = getattr(ns, "pd", False), getattr(ns, "routing_overhead", 0)  # (`tune` has neither flag)
    if (pd or overhead) and not getattr(ns, "start_server", False):
        raise ValueError("--pd / --routing-overhead: need --start-server (they describe the server it starts)")
    if overhead < 0:
        raise ValueError(f"--routing-overhead: must be >= 0, got {overhead}")
    if getattr(ns, "compare_routing", None) is not None:
        if not ns.start_server:
            raise ValueError("--compare-routing: needs --start-server (it starts one app per policy)")
        if len(ns.request_rate) != 1 or pd or getattr(ns, "chaos_kill_every", None):
            raise ValueError("--compare-routing: runs one --request-rate, without --pd or --chaos-kill-every")
    if getattr(ns, "offline_baseline", False):
        if not ns.start_server:
            raise ValueError("--offline-baseline: needs --start-server (the offline engine takes the settings of "
                             "the server it starts)")
        if pd or (ns.data_parallel_size or 1) > 1 or shared_prefix_shape(ns) is not None \
                or ns.compare_routing is not None:
            raise ValueError("--offline-baseline: compares one engine on the random workload (without --pd, "
                             "--data-parallel-size > 1, --workload shared-prefix or --compare-routing)")
    return parse_slo(ns.slo) if ns.slo else None


# --------------------------------------------------------------------------- the server it starts


def server_settings(ns: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"kv_cache_memory": ns.kv_cache_memory, "dtype": ns.dtype}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_cpus_per_engine", "cpu_threads",
                 "quantization", "api_key", "data_parallel_size", "routing_policy", "kv_offload_size",
                 "stream_interval", "direct_ingress"):
        if getattr(ns, name, None) is not None:
            settings[name] = getattr(ns, name)
    if getattr(ns, "pd", False):
        settings.update(num_prefill_engines=ns.num_prefill_engines, num_decode_engines=ns.num_decode_engines,
                        kv_connector=ns.kv_connector)
    shape = shared_prefix_shape(ns)
    if shape is not None:
        from pagedserve.engine.config import EngineConfig

        block_size = ns.block_size or EngineConfig.model_fields["block_size"].default
        settings["num_kv_blocks"] = shape.cache_blocks(block_size, ns.kv_demand_ratio, ns.max_concurrency or 1)
    return settings


def shared_prefix_shape(ns: argparse.Namespace) -> SharedPrefixShape | None:
    if getattr(ns, "workload", "random") != "shared-prefix":
        return None
    return SharedPrefixShape(ns.tenants, ns.context_len, ns.questions, ns.question_len, ns.output_len)


def vocabulary_ids(model: str | None) -> list[int] | None:
    """Every ordinary token id of MODEL when it is a local HF folder (its tokenizer and config), else None.
    The shared-prefix workload draws its contexts from these rather than from a sample text's tokens, which a
    word-level tokenizer (bench/random_model.py's) maps to a single unknown id: all contexts would be alike."""
    if model is None or not os.path.isfile(os.path.join(model, "config.json")):
        return None
    try:
        from transformers import AutoConfig, AutoTokenizer

        return vocab_token_ids(AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model).vocab_size)
    except (OSError, ValueError, AttributeError):
        return None


def make_workload(ns: argparse.Namespace, token_ids: list[int], model: str | None = None) -> list[BenchRequest]:
    shape = shared_prefix_shape(ns)
    if shape is not None:
        return shared_prefix(shape, ns.seed, vocabulary_ids(model) or token_ids)
    return synthetic(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, token_ids)


# --------------------------------------------------------------------------- one rate


def run_entry(load: LoadRun, name: str, params: dict[str, Any], slo: dict[str, float] | None,
              facts: ModelFacts | None, machine: Machine | None) -> dict[str, Any]:
    """One rate's run in the report's shape (goodput with an SLO, the decode roofline with figures)."""
    done = [r for r in load.results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration = load.duration_s
    tpots = [t for r in done if (t := r.tpot) is not None]
    entry: dict[str, Any] = {
        "name": name, "params": params, "num_requests": len(load.results), "completed": len(done),
        "failed": len(load.results) - len(done), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "duration_s": duration, "throughput": rep.throughput(len(done), prompt_tokens, output_tokens, duration),
        "latency_ms": {"ttft": rep.summarize(r.ttft for r in done), "tpot": rep.summarize(tpots),
                       "itl": rep.summarize(x for r in done for x in r.itls),
                       "e2e": rep.summarize(r.e2e for r in done)},
        "roofline": {},
        "errors": sorted({r.error for r in load.results if not r.ok})[:5],
    }
    if slo:
        entry["goodput"] = {"slo_ms": {k: v * 1e3 for k, v in slo.items()},
                            **goodput([r.latency() for r in load.results], slo, duration)}
    if facts is not None and machine is not None and tpots and done:
        tpot_mean = sum(tpots) / len(tpots)
        batch = max(1, round(entry["throughput"]["output_tokens_per_s"] * tpot_mean))
        mean_context = (prompt_tokens + output_tokens / 2) / len(done)
        entry["roofline"]["decode"] = step_roofline(facts, machine, tokens=batch,
                                                    context_tokens=round(batch * mean_context),
                                                    measured_s=tpot_mean).to_dict()
    return entry


def sweep(url: str, info: ServerInfo, workload: list[BenchRequest], ns: argparse.Namespace,
          slo: dict[str, float] | None, facts: ModelFacts | None, machine: Machine | None,
          params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
          observe: Callable[[LoadRun, dict[str, Any]], None] | None = None, warm: bool = True) -> list[dict[str, Any]]:
    """Run the workload at every --request-rate; one report run each (`observe(load, run)` may add to it).
    `warm`: first `--num-warmups` requests (`warm_up`), for a server that has not served this workload yet."""
    if warm:
        warm_up(url, info.model, workload, ns.num_warmups, ns.seed, headers or {}, ns.timeout)
    runs = []
    for rate in ns.request_rate:
        point = {**(params or {}), "request_rate": rate_label(rate), "max_concurrency": ns.max_concurrency}
        name = ", ".join(f"{k} {v}" for k, v in point.items() if v is not None)
        before = scrape(url, headers or {}, ns.timeout)
        load = run_load(url, info.model, workload, rate, ns.max_concurrency, ns.seed, headers or {}, ns.timeout,
                        desc=f"rate {rate_label(rate)}")
        entry = run_entry(load, name, point, slo, facts, machine)
        split = overhead_delta(before, scrape(url, headers or {}, ns.timeout))
        if split is not None:  # the server's own split of where the time went (bench/overhead_split.py)
            entry["overhead"] = split
        if observe is not None:
            observe(load, entry)
        runs.append(entry)
    return runs


def check_fits(info: ServerInfo, ns: argparse.Namespace) -> None:
    shape = shared_prefix_shape(ns)
    if shape is not None:
        if info.max_model_len and shape.request_len > info.max_model_len:
            raise ValueError(f"--context-len + --question-len + --output-len: {shape.request_len} tokens exceed the "
                             f"server's max_model_len {info.max_model_len}")
        return
    if info.max_model_len and ns.input_len[1] + ns.output_len[1] > info.max_model_len:
        raise ValueError(f"--input-len + --output-len: up to {ns.input_len[1] + ns.output_len[1]} tokens exceed "
                         f"the server's max_model_len {info.max_model_len}")


def sweep_summary(runs: list[dict[str, Any]], slo: dict[str, float] | None, min_attainment: float) -> dict:
    summary: dict[str, Any] = {"max_output_tokens_per_s": max(r["throughput"]["output_tokens_per_s"] for r in runs)}
    if slo:
        pairs = [(float(r["params"]["request_rate"]), r["goodput"]["attainment"]) for r in runs]
        summary["slo_ms"] = {k: v * 1e3 for k, v in slo.items()}
        summary["slo_attainment"] = min_attainment
        summary["max_rate_meeting_slo"] = max_rate_meeting_slo(pairs, min_attainment)
        summary["max_goodput_requests_per_s"] = max(r["goodput"]["requests_per_s"] for r in runs)
    return summary


def runs_table(runs: list[dict[str, Any]]) -> str:
    rows = []
    for r in runs:
        t, lat = r["throughput"], r["latency_ms"]
        good = r.get("goodput")
        rows.append([r["name"], f"{r['completed']}/{r['num_requests']}", t["requests_per_s"],
                     t["output_tokens_per_s"], *((lat[k] or {}).get(s) for k, s in
                                                 (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"),
                                                  ("tpot", "p99"), ("itl", "p50"), ("itl", "p99"),
                                                  ("e2e", "p99"))),
                     good["requests_per_s"] if good else None,
                     f"{good['attainment']:.0%}" if good else None])
    return rep.table(["point", "done", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                      "ITL p50", "ITL p99", "E2E p99", "goodput", "in SLO"], rows)


def run(ns: argparse.Namespace) -> int:
    slo = check_load_args(ns)
    chaos.check_chaos_args(ns)
    if ns.compare_routing is not None:
        from pagedserve.bench.routing_bench import run_routing_comparison

        return run_routing_comparison(ns)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    figures = common.machine(ns)
    server = None
    overhead = None
    offline = None
    model = ns.model
    try:
        if ns.start_server:
            if model is None:
                from pagedserve.engine.models.default_model import resolve_default_model

                model = resolve_default_model()
            if ns.offline_baseline:  # before the server exists: nothing of it runs beside the offline engine
                offline = offline_baseline(model, server_settings(ns),
                                           lambda token_ids: make_workload(ns, token_ids, model))
            from pagedserve.cluster.executor.ray_utils import free_port

            server = LocalServer.start(model, ns.port or free_port(), server_settings(ns))
            ns.base_url = server.url
        info = server_info(ns.base_url, headers, ns.timeout)
        check_fits(info, ns)
        facts = None
        if figures is not None and model is not None:
            from pagedserve.bench.roofline import model_facts

            facts = model_facts(model, ns.dtype)
        workload = make_workload(ns, info.token_ids, model)
        runs = sweep(ns.base_url, info, workload, ns, slo, facts, figures, headers=headers)
        compared = None
        if ns.chaos_kill_every:
            every = ns.chaos_kill_every
            with chaos.ReplicaKiller(server.app_name if server else ns.app_name, every, ns.seed) as killer:
                chaos_runs = sweep(ns.base_url, info, workload, ns, slo, facts, figures,
                                   params={"chaos_kill_every_s": every}, headers=headers, observe=killer.observe,
                                   warm=False)
            compared = [chaos.comparison(calm, hit) for calm, hit in zip(runs, chaos_runs)]
            runs += chaos_runs
        if ns.routing_overhead and server is not None:
            from pagedserve.bench.routing_overhead import routing_overhead

            overhead = routing_overhead(server.args, ns.routing_overhead)
    finally:
        if server is not None:
            server.stop()
    summary = sweep_summary(runs, slo, ns.slo_attainment)
    if offline is not None:
        for r in runs:
            r["served_to_offline"] = r["throughput"]["output_tokens_per_s"] / offline["output_tokens_per_s"]
        summary["offline_baseline"] = offline
    if compared is not None:
        summary["chaos"] = compared
    if overhead is not None:
        summary["routing_overhead"] = overhead
    config = {k: v for k, v in vars(ns).items() if k not in ("bench_func", "api_key")}
    report = rep.make_report("serve", model or info.model, config, runs, figures.to_dict() if figures else None,
                             summary)
    shape = (f"PD: {ns.num_prefill_engines} prefill + {ns.num_decode_engines} decode" if ns.pd else "monolithic")
    parts = [f"pagedserve bench serve: {info.model} at {ns.base_url} ({shape})", runs_table(runs)]
    if overhead is not None:
        parts.append(f"routing overhead of a one-token request ({overhead['deployment']}): Serve handle "
                     f"{overhead['serve_handle_median_ms']:.2f} ms, in-process coordinator "
                     f"{overhead['in_process_coordinator_median_ms']:.2f} ms median "
                     f"(+{overhead['serve_overhead_ms']:.2f} ms)")
    if offline is not None:
        parts.append(f"offline baseline (the same {offline['num_requests']} requests through an offline engine, "
                     f"run before the server started): {offline['output_tokens_per_s']:.1f} out tok/s; served / "
                     "offline: " + ", ".join(f"{r['name']} {r['served_to_offline']:.2f}x" for r in runs))
    for r in runs:
        parts.append(f"{r['name']}:\n{rep.latency_table(r)}")
    if slo:
        parts.append(f"SLO {ns.slo} (>= {ns.slo_attainment:.0%} of requests): highest rate meeting it: "
                     f"{summary['max_rate_meeting_slo']}; best goodput {summary['max_goodput_requests_per_s']:.2f} "
                     "req/s")
    if compared is not None:
        parts.append(f"chaos (an engine replica killed every {ns.chaos_kill_every:g} s; "
                     f"{sum(c['kills'] for c in compared)} kills): without -> with kills\n"
                     + "\n".join(f"  {key}: {c['without_kills'][key]} -> {c['with_kills'][key]}"
                                  for c in compared for key in c["without_kills"])
                     + "".join(f"\n  migration cost (kill -> first token after the seam, ms): {c['migration_cost_ms']}"
                               for c in compared))
    if facts is None and figures is not None:
        parts.append("(roofline: give MODEL, the served model's path, to see it)")
    parts += [rep.machine_line(report["machine"]), rep.roofline_table(runs)]
    if overhead_table(runs):
        parts.append(overhead_table(runs))
    if ns.plot:
        from pagedserve.bench.plots import plot_latency_vs_load

        plot_latency_vs_load(runs, ns.plot)
        parts.append(f"wrote {ns.plot}")
    common.finish(report, ns, "\n\n".join(parts))
    return 0 if all(r["failed"] == 0 for r in runs) else 1

