"""The runner of `pagedserve bench serve --compare-routing`: one app per routing policy on the same engine
settings and workload (the plumbing, without a server: routing_compare.py), one table, one report."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from pagedserve.bench import common, routing_compare
from pagedserve.bench import report as rep
from pagedserve.bench.loadgen import run_load, server_info
from pagedserve.bench.local_server import LocalServer
from pagedserve.bench.serve_load import check_fits, make_workload, run_entry, server_settings, \
    shared_prefix_shape
from pagedserve.bench.slo import rate_label
from pagedserve.bench.workload import BenchRequest, synthetic


def settled_counters(url: str, headers: dict[str, str], timeout: float, period_s: float = 1.0,
                     max_wait_s: float = 20.0) -> dict[str, float]:
    """The server's cache counters once two reads `period_s` apart agree (the engines' stats reach the
    ingress a stats period late), or after `max_wait_s`."""
    last = routing_compare.scrape_counters(url, headers, timeout)
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        time.sleep(period_s)
        now = routing_compare.scrape_counters(url, headers, timeout)
        if now == last:
            break
        last = now
    return last


def run_routing_comparison(ns: argparse.Namespace) -> int:
    """--compare-routing: the workload on one app per policy (routing_compare.compare), one table, one report."""
    from pagedserve.cluster.executor.ray_utils import free_port

    model = ns.model
    if model is None:
        from pagedserve.engine.models.default_model import resolve_default_model

        model = resolve_default_model()
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    base = server_settings(ns)
    base.setdefault("data_parallel_size", 2)
    offload_size = ns.kv_offload_size or "256MiB"
    rate = ns.request_rate[0]
    state: dict[str, Any] = {}

    port = ns.port or free_port()  # one port for every arm: Serve keeps its HTTP proxy between apps

    def start(settings: dict[str, Any]) -> LocalServer:
        return LocalServer.start(model, port, settings)

    def measure(server: LocalServer, arm: routing_compare.PolicyRun) -> dict[str, Any]:
        if "workload" not in state:  # the same requests for every arm (the model, hence its tokens, is one)
            info = server_info(server.url, headers, ns.timeout)
            check_fits(info, ns)
            state.update(info=info, workload=make_workload(ns, info.token_ids, model))
        info = state["info"]
        # --num-warmups per engine replica, each shorter than a KV block: the arms' caches start empty alike.
        if ns.num_warmups:
            warm = [BenchRequest(r.prompt_token_ids[:8], 2)
                    for r in synthetic(ns.num_warmups * base["data_parallel_size"], (8, 8), (2, 2), ns.seed + 1,
                                       info.token_ids)]
            run_load(server.url, info.model, warm, math.inf, None, ns.seed, headers, ns.timeout, desc="warm-up")
        before = settled_counters(server.url, headers, ns.timeout)
        load = run_load(server.url, info.model, state["workload"], rate, ns.max_concurrency, ns.seed, headers,
                        ns.timeout, desc=arm.label)
        after = settled_counters(server.url, headers, ns.timeout)
        point = {"policy": arm.label, "request_rate": rate_label(rate), "max_concurrency": ns.max_concurrency}
        entry = run_entry(load, f"policy {arm.label}", point, None, None, None)
        entry["cache"] = routing_compare.cache_delta(before, after)
        return entry

    try:
        entries = routing_compare.compare(ns.compare_routing, base, offload_size, start, measure,
                                          log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        LocalServer("", "").stop(everything=True)
    summary = routing_compare.summary(entries)
    summary["engine_kv_blocks"] = base.get("num_kv_blocks")
    shape = shared_prefix_shape(ns)
    config = {k: v for k, v in vars(ns).items() if k not in ("bench_func", "api_key", "compare_routing")}
    config["compare_routing"] = [arm.label for arm in ns.compare_routing]
    report = rep.make_report("serve", model, config, entries, None, summary)
    what = (f"{shape.tenants} tenants x {shape.questions} questions, {shape.context_len}-token contexts, "
            f"KV demand {ns.kv_demand_ratio:g}x one engine's cache ({base.get('num_kv_blocks')} blocks)"
            if shape is not None else f"{ns.num_prompts} random prompts")
    parts = [f"pagedserve bench serve --compare-routing: {state['info'].model if state else model}, "
             f"{base['data_parallel_size']} engines, {what}, rate {rate_label(rate)}, "
             f"max concurrency {ns.max_concurrency}",
             routing_compare.table(entries), "aims:", *routing_compare.aims_lines(summary["aims"])]
    common.finish(report, ns, "\n".join(parts))
    return 0 if all(e["failed"] == 0 for e in entries) else 1
