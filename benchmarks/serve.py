"""Serving benchmark: a load generator against a live OpenAI-compatible endpoint.

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Each is a streamed /v1/completions request with a random prompt of
token ids (drawn from the server's own tokenization of a text, so every id is in the vocabulary)
and `ignore_eos`, so output lengths are exact. TTFT, inter-token latency (gaps between streamed
chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and end-to-end latency are measured from SSE
chunk arrival times, reported as mean / p50 / p90 / p99 in a table and a JSON file, and with
--plot as latency against load over several rates (--request-rate 1,2,4,inf).

  python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
  python benchmarks/serve.py --start-server --model /path/to/model --num-prompts 100 --max-concurrency 16 \\
      --request-rate 2,8,inf --result-json serve.json --plot serve.png

Scale-out (with --start-server): `--data-parallel-size 2 --num-ingress-replicas 1,2` runs the sweep
once per ingress count against the same engine replicas (only the ingress deployment is redeployed)
and reports, for each, the rate where TTFT p99 leaves its floor (first rate above
`--knee-factor` x the lowest rate's p99). `--routing-overhead N` then times N one-token requests
straight to the engines through the Serve handle (request router + replica) and through the in-process
`DPCoordinator` over an engine actor of the same settings, and reports the medians and their difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed-size "
    "blocks; prefix caching reuses them across requests. def fibonacci(n): return n if n < 2 else "
    "fibonacci(n - 1) + fibonacci(n - 2). import os, sys; class Engine: def step(self): pass. "
)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_range(text: str) -> tuple[int, int]:
    """"128" or "64:256" -> (low, high), inclusive."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if r.strip() in ("inf", "") else float(r) for r in text.split(",")]
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("request rates must be > 0 (or inf)")
    return rates


def make_workload(vocab_ids: list[int], num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.choice(vocab_ids) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(num)]


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if event.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    return result


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99))}


async def run_load(base_url: str, model: str, workload: list[tuple[list[int], int]], rate: float,
                   max_concurrency: int | None, seed: int, headers: dict[str, str], timeout: float) -> dict:
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(workload), max_keepalive_connections=64)

    async def guarded(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> RequestResult:
        if sem is None:
            return await one_request(client, model, prompt, max_tokens)
        async with sem:
            return await one_request(client, model, prompt, max_tokens)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(guarded(client, prompt, max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "num_prompts": len(workload),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _summary([r.ttft for r in done]),
        "tpot_ms": _summary([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _summary([x for r in done for x in r.itls]),
        "e2e_ms": _summary([r.e2e for r in done]),
    }


def format_table(result: dict) -> str:
    lines = [
        f"{'request rate':<28}{result['request_rate']}   max concurrency {result['max_concurrency']}",
        f"{'completed / failed':<28}{result['completed']} / {result['failed']}",
        f"{'duration (s)':<28}{result['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{result['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{result['output_throughput']:.1f}",
        f"{'total throughput (tok/s)':<28}{result['total_token_throughput']:.1f}",
        f"{'latency (ms)':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = result[key]
        lines.append(f"{label:<28}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = [r["request_throughput"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end")):
        for stat in ("p50", "p90", "p99"):
            ax.plot(load, [r[key][stat] for r in results], marker="o", label=stat)
        ax.set_xlabel("achieved load (requests/s)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} latency vs load")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def vocab_ids_from_server(base_url: str, headers: dict[str, str], timeout: float) -> tuple[str, list[int], int]:
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as client:
        card = client.get("/v1/models").raise_for_status().json()["data"][0]
        tokens = client.post("/tokenize", json={"prompt": SEED_TEXT, "add_special_tokens": False})
        ids = sorted(set(tokens.raise_for_status().json()["tokens"]))
    return card["id"], ids, int(card.get("max_model_len") or 0)


def start_local_server(model: str, port: int, extra: dict) -> None:
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from pagedserve.cluster.serving.settings import ServeArgs
    from pagedserve.cluster.serve_app import start_server

    args = ServeArgs(model=model, port=port, **extra)
    print(f"starting a server for {args.model} on port {port} with {args.num_ingress_replicas} ingress "
          f"replica(s) ...", file=sys.stderr, flush=True)
    start_server(args)


def ttft_knee(results: list[dict], factor: float) -> float | None:
    """The first request rate whose TTFT p99 exceeds `factor` x the lowest rate's (the floor); None if none."""
    ordered = sorted(results, key=lambda r: float(r["request_rate"]))
    floor = ordered[0]["ttft_ms"]["p99"]
    return next((r["request_rate"] for r in ordered[1:] if r["ttft_ms"]["p99"] > factor * floor), None)


def routing_overhead(model: str, extra: dict, n: int) -> dict:
    """Median latency of a one-token request through the Serve handle (router + engine replica) and through
    the in-process DPCoordinator over an engine actor with the same settings (same process, same Ray)."""
    import statistics

    from ray import serve

    from pagedserve.cluster.coordinator import DPCoordinator
    from pagedserve.cluster.engine_actor import start_engine_actors, wait_engines_ready
    from pagedserve.cluster.serve_client import ServeEngineClient
    from pagedserve.cluster.serving.settings import ServeArgs

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
        coordinator = DPCoordinator(engines, block_size=args.block_size)
        local_times = asyncio.run(timed(coordinator))
    finally:
        import ray

        for engine in engines:
            ray.kill(engine, no_restart=True)
    serve_ms, local_ms = statistics.median(serve_times) * 1e3, statistics.median(local_times) * 1e3
    return {"requests": n, "serve_handle_median_ms": serve_ms, "in_process_coordinator_median_ms": local_ms,
            "serve_overhead_ms": serve_ms - local_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--start-server", action="store_true", help="start a local server for --model first")
    parser.add_argument("--model", default=None, help="model directory for --start-server (default: bundled)")
    parser.add_argument("--port", type=int, default=None, help="port for --start-server (default: a free one)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="for --start-server")
    parser.add_argument("--block-size", type=int, default=16, help="for --start-server")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                        help="requests/s (Poisson); comma-separated for a sweep; inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len", type=parse_range, default=(32, 128))
    parser.add_argument("--output-len", type=parse_range, default=(16, 64))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG of latency against load (over the rates)")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas for --start-server")
    parser.add_argument("--num-cpus-per-engine", type=float, default=1.0, help="for --start-server")
    parser.add_argument("--num-ingress-replicas", default="1",
                        help="comma-separated ingress replica counts for --start-server (one sweep each)")
    parser.add_argument("--knee-factor", type=float, default=2.0,
                        help="TTFT p99 'leaves its floor' above this multiple of the lowest rate's p99")
    parser.add_argument("--routing-overhead", type=int, default=0,
                        help="with --start-server: time this many one-token requests via the Serve handle and "
                             "via the in-process coordinator")
    ns = parser.parse_args(argv)

    ingress_counts = [int(c) for c in ns.num_ingress_replicas.split(",")] if ns.start_server else [None]
    extra = {"kv_cache_memory": ns.kv_cache_memory, "block_size": ns.block_size, "api_key": ns.api_key,
             "data_parallel_size": ns.data_parallel_size, "num_cpus_per_engine": ns.num_cpus_per_engine}
    if ns.start_server:
        from pagedserve.cluster.ray_utils import free_port

        port = ns.port or free_port()
        ns.base_url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    results, knees, overhead = [], {}, None
    try:
        for count in ingress_counts:
            if count is not None:  # (re)deploys only the ingress when just the count changes
                start_local_server(ns.model, port, {**extra, "num_ingress_replicas": count})
            model, vocab_ids, max_model_len = vocab_ids_from_server(ns.base_url, headers, ns.timeout)
            if max_model_len and ns.input_len[1] + ns.output_len[1] > max_model_len:
                parser.error(f"--input-len + --output-len exceed the server's max_model_len {max_model_len}")
            workload = make_workload(vocab_ids, ns.num_prompts, ns.input_len, ns.output_len, ns.seed)
            sweep = []
            for rate in ns.request_rate:
                result = asyncio.run(run_load(ns.base_url, model, workload, rate, ns.max_concurrency, ns.seed,
                                              headers, ns.timeout))
                result.update(model=model, input_len=list(ns.input_len), output_len=list(ns.output_len),
                              num_ingress_replicas=count)
                sweep.append(result)
                print(f"ingress replicas: {count}" if count is not None else "", flush=True)
                print(format_table(result), flush=True)
                print(flush=True)
            results += sweep
            if count is not None and len(sweep) > 1:
                knees[count] = ttft_knee(sweep, ns.knee_factor)
                print(f"ingress replicas {count}: TTFT p99 leaves its floor at rate {knees[count]}", flush=True)
        if ns.start_server and ns.routing_overhead:
            overhead = routing_overhead(ns.model, extra, ns.routing_overhead)
            print(f"routing overhead: {json.dumps(overhead)}", flush=True)
    finally:
        if ns.start_server:
            from ray import serve

            serve.shutdown()
    if ns.result_json:
        body: object = results if len(results) > 1 else results[0]
        if knees or overhead:
            body = {"sweeps": results, "ttft_knee_rate": knees, "routing_overhead": overhead}
        Path(ns.result_json).write_text(json.dumps(body, indent=2))
    if ns.plot:
        plot(results, ns.plot)
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
