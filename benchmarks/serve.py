"""Scale-out study of the Serve app, on top of `pagedserve bench serve`'s load generator.

Plain load tests are `pagedserve bench serve` (docs/benchmarks.md). This script keeps the experiment
that needs to redeploy parts of the app between sweeps: with `--data-parallel-size 2
--num-ingress-replicas 1,2` it runs the request-rate sweep once per ingress count against the same
engine replicas (only the ingress deployment is redeployed) and reports, for each, the rate where TTFT
p99 leaves its floor (the first rate above `--knee-factor` x the lowest rate's p99). `--routing-overhead
N` then times N one-token requests straight to the engines through the Serve handle (request router +
replica) and through the in-process `DPCoordinator` over an engine actor of the same settings.

  python benchmarks/serve.py --model /path/to/model --data-parallel-size 2 --num-ingress-replicas 1,2 \\
      --request-rate 2,8,inf --num-prompts 100 --result-json scaleout.json

`--pd` compares prefill/decode disaggregation with data parallelism on one workload instead: the same
load (by default long prompts mixed with long outputs) against 1 prefill + 1 decode engine (`--kv-connector`,
default ray) and against 2 monolithic engines, reporting TTFT / TPOT / ITL p50 and p99 and the KV bytes
moved per request (from the server's `pagedserve:kv_transfer_bytes` counter):

  python benchmarks/serve.py --pd --input-len 512:1024 --output-len 64:256 --request-rate 1,4 --num-prompts 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path

from pagedserve.bench import report as rep
from pagedserve.bench.loadgen import run_load, server_info
from pagedserve.bench.serve_load import LocalServer, parse_rates, run_entry, runs_table
from pagedserve.bench.slo import rate_label
from pagedserve.bench.workload import parse_range, synthetic


def ttft_knee(results: list[dict], factor: float) -> float | str | None:
    """The first request rate whose TTFT p99 exceeds `factor` x the lowest rate's (the floor); None if none."""
    ordered = sorted(results, key=lambda r: float(r["params"]["request_rate"]))
    floor = ordered[0]["latency_ms"]["ttft"]["p99"]
    return next((r["params"]["request_rate"] for r in ordered[1:] if r["latency_ms"]["ttft"]["p99"] > factor * floor),
                None)


def routing_overhead(model: str, extra: dict, n: int) -> dict:
    """Median latency of a one-token request through the Serve handle (router + engine replica) and through
    the in-process DPCoordinator over an engine actor with the same settings (same process, same Ray)."""
    import ray
    from ray import serve

    from pagedserve.cluster.serve.coordinator import DPCoordinator
    from pagedserve.cluster.serve.engine_actor import start_engine_actors, wait_engines_ready
    from pagedserve.cluster.serve.client import ServeEngineClient
    from pagedserve.cluster.settings import ServeArgs

    args = ServeArgs(model=model, **extra)
    params = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    prompts = [[(7 * i + k) % 200 + 10 for k in range(32)] for i in range(n)]

    async def timed(client) -> list[float]:
        times = []
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            async for _ in client.generate(f"overhead-{id(client)}-{i}", prompt, params):
                pass
            times.append(time.perf_counter() - start)
        return times

    handle = serve.get_deployment_handle(f"{args.app_name}-engine", args.app_name)
    serve_times = asyncio.run(timed(ServeEngineClient(handle, args.app_name, f"{args.app_name}-engine")))
    engines = start_engine_actors(args.engine_kwargs(), 1, args.num_cpus_per_engine)
    try:
        wait_engines_ready(engines, timeout_s=300)
        local_times = asyncio.run(timed(DPCoordinator(engines, block_size=args.block_size)))
    finally:
        for engine in engines:
            ray.kill(engine, no_restart=True)
    serve_ms, local_ms = statistics.median(serve_times) * 1e3, statistics.median(local_times) * 1e3
    return {"requests": n, "serve_handle_median_ms": serve_ms, "in_process_coordinator_median_ms": local_ms,
            "serve_overhead_ms": serve_ms - local_ms}


def kv_bytes_moved(url: str) -> float:
    """The server's cumulative KV bytes pulled by decode engines (0 without prefill/decode)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name in ("pagedserve:kv_transfer_bytes_total", "pagedserve:kv_transfer_bytes"))


PD_SHAPES = (
    ("PD: 1 prefill + 1 decode engine", {"num_prefill_engines": 1, "num_decode_engines": 1}),
    ("DP: 2 monolithic engines", {"data_parallel_size": 2}),
)


def pd_comparison(model: str, port: int, extra: dict, ns: argparse.Namespace) -> list[dict]:
    """The same workload and rates against the PD shape and the DP shape, one server after the other."""
    results = []
    base = {k: v for k, v in extra.items() if k != "data_parallel_size"}
    for label, shape in PD_SHAPES:
        settings = {**base, **shape}
        if "num_prefill_engines" in shape:
            settings["kv_connector"] = ns.kv_connector
        server = LocalServer.start(model, port, settings)
        try:
            info = server_info(server.url, {}, ns.timeout)
            workload = synthetic(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, info.token_ids)
            for rate in ns.request_rate:
                before = kv_bytes_moved(server.url)
                load = run_load(server.url, info.model, workload, rate, ns.max_concurrency, ns.seed, {}, ns.timeout)
                params = {"shape": label, "request_rate": rate_label(rate)}
                entry = run_entry(load, f"{label}, rate {rate_label(rate)}", params, None, None, None)
                entry["kv_bytes_per_request"] = (kv_bytes_moved(server.url) - before) / max(1, entry["completed"])
                results.append(entry)
        finally:
            server.stop()
    rows = [[r["name"], r["completed"], r["failed"],
             *(r["latency_ms"][m][q] if r["latency_ms"][m] else float("nan")
               for m in ("ttft", "tpot", "itl") for q in ("p50", "p99")),
             r["kv_bytes_per_request"] / 1024] for r in results]
    print(rep.table(["shape, rate", "done", "failed", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
                     "ITL p99", "KV KiB/req"], rows), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or GGUF file (default: the default model)")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=parse_rates, default=[math.inf])
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len", type=parse_range, default=(32, 128))
    parser.add_argument("--output-len", type=parse_range, default=(16, 64))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--num-cpus-per-engine", type=float, default=1.0)
    parser.add_argument("--num-ingress-replicas", default="1", help="comma-separated counts (one sweep each)")
    parser.add_argument("--knee-factor", type=float, default=2.0)
    parser.add_argument("--routing-overhead", type=int, default=0)
    parser.add_argument("--pd", action="store_true",
                        help="compare 1 prefill + 1 decode engine with 2 monolithic engines on the same load")
    parser.add_argument("--kv-connector", default="ray", choices=["ray", "torch_p2p"],
                        help="the PD shape's KV transport (--pd)")
    ns = parser.parse_args(argv)

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.engine.models.default_model import resolve_default_model

    model = ns.model or resolve_default_model()
    port = ns.port or free_port()
    extra = {"kv_cache_memory": ns.kv_cache_memory, "block_size": ns.block_size,
             "data_parallel_size": ns.data_parallel_size, "num_cpus_per_engine": ns.num_cpus_per_engine}
    if ns.pd:
        results = pd_comparison(model, port, extra, ns)
        if ns.result_json:
            Path(ns.result_json).write_text(json.dumps({"pd_comparison": rep.jsonable(results)}, indent=2))
        return 0 if all(r["failed"] == 0 for r in results) else 1
    results, knees, overhead, server = [], {}, None, None
    try:
        for count in [int(c) for c in ns.num_ingress_replicas.split(",")]:
            # (re)deploys only the ingress when just the count changes
            server = LocalServer.start(model, port, {**extra, "num_ingress_replicas": count})
            info = server_info(server.url, {}, ns.timeout)
            workload = synthetic(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, info.token_ids)
            sweep = []
            for rate in ns.request_rate:
                load = run_load(server.url, info.model, workload, rate, ns.max_concurrency, ns.seed, {}, ns.timeout)
                params = {"num_ingress_replicas": count, "request_rate": rate_label(rate)}
                sweep.append(run_entry(load, f"ingress {count}, rate {rate_label(rate)}", params, None, None, None))
            print(runs_table(sweep), flush=True)
            results += sweep
            if len(sweep) > 1:
                knees[count] = ttft_knee(sweep, ns.knee_factor)
                print(f"ingress replicas {count}: TTFT p99 leaves its floor at rate {knees[count]}", flush=True)
        if ns.routing_overhead:
            overhead = routing_overhead(model, extra, ns.routing_overhead)
            print(f"routing overhead: {json.dumps(overhead)}", flush=True)
    finally:
        if server is not None:
            server.stop()
    if ns.result_json:
        body = {"sweeps": rep.jsonable(results), "ttft_knee_rate": knees, "routing_overhead": overhead}
        Path(ns.result_json).write_text(json.dumps(body, indent=2))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
