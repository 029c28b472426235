"""`pagedserve bench serve --compare-routing`: the same workload on the same engines under each routing policy.

One app per policy, started and deleted in turn on the one Ray instance (`local_server.LocalServer`), each with
the same engine settings, workload, rate and seed, so that only the router (and, for "exact+offload", the
offload tier) differs: cache-blind "random" and "power_of_two", the approximate "prefix_approx", "exact"
(routing on the engines' KV events) and "exact+offload" (exact, with a `--kv-offload-size` tier under every
engine: on CPU one /dev/shm tier that the node's engines share). Each app starts with cold caches.

Per policy: TTFT p50/p90, output throughput and the prefix hit rate, from the server's own counters on
/metrics before and after the run: (device prefix-cache hits + tokens reloaded from the tier) / prompt
tokens looked up; the router's decisions by kind; and, under exact routing, how many requests' predicted
cached tokens equalled what their engine found. The summary sets the ratios the issue aims at (exact
vs approximate P90 TTFT; the tier vs exact alone, hit rate and throughput) beside their targets.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench import report as rep


@dataclass(frozen=True)
class PolicyRun:
    """One arm of the comparison: its label, the router's policy, whether the engines get an offload tier."""

    label: str
    routing_policy: str
    offload: bool = False


POLICY_RUNS = {run.label: run for run in (
    PolicyRun("random", "random"), PolicyRun("power_of_two", "power_of_two"),
    PolicyRun("prefix_approx", "prefix_approx"), PolicyRun("exact", "exact"),
    PolicyRun("exact+offload", "exact", offload=True))}

# The aims: (name, numerator arm, denominator arm, figure, the ratio aimed at or above). TTFT is
# lower-better, so its ratio is the approximate arm's over the exact one's.
AIMS = (("p90_ttft_prefix_approx_over_exact", "prefix_approx", "exact", "ttft_p90_ms", 3.0),
        ("hit_rate_tier_over_exact", "exact+offload", "exact", "prefix_hit_rate", 2.0),
        ("throughput_tier_over_exact", "exact+offload", "exact", "output_tokens_per_s", 1.5))

PREFIX = "pagedserve:"
CACHE_COUNTERS = {"prefix_cache_queries_total": "queries", "prefix_cache_hits_total": "device_hits",
                  "kv_offload_hits_total": "tier_hits"}


def parse_policies(text: str) -> list[PolicyRun]:
    """"all" or a comma-separated list of POLICY_RUNS labels -> the arms, in the order given; argparse type."""
    labels = list(POLICY_RUNS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [label for label in labels if label not in POLICY_RUNS]
    if unknown or not labels:
        raise argparse.ArgumentTypeError(f"expected all or a comma-separated list of {', '.join(POLICY_RUNS)}, "
                                         f"got {text!r}")
    return [POLICY_RUNS[label] for label in dict.fromkeys(labels)]


def arm_settings(base: dict[str, Any], arm: PolicyRun, offload_size: str) -> dict[str, Any]:
    """The server settings of one arm: the shared ones plus its policy (and its tier)."""
    settings = {k: v for k, v in base.items() if k not in ("routing_policy", "kv_offload_size")}
    settings["routing_policy"] = arm.routing_policy
    if arm.offload:
        settings["kv_offload_size"] = offload_size
    return settings


# --------------------------------------------------------------------------- the server's counters


def cache_counters(metrics_text: str) -> dict[str, float]:
    """Prefix-cache and offload-tier token counters, and routing decisions by kind, from /metrics text."""
    out: dict[str, float] = dict.fromkeys(CACHE_COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name in CACHE_COUNTERS:
                out[CACHE_COUNTERS[name]] += sample.value
            elif name == "routing_decisions_total" and "decision" in sample.labels:
                key = "decision:" + sample.labels["decision"]
                out[key] = out.get(key, 0.0) + sample.value
            elif name == "routing_cached_token_predictions_total" and "outcome" in sample.labels:
                key = "prediction:" + sample.labels["outcome"]
                out[key] = out.get(key, 0.0) + sample.value
    return out


def scrape_counters(base_url: str, headers: dict[str, str], timeout: float) -> dict[str, float]:
    response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout)
    response.raise_for_status()
    return cache_counters(response.text)


def cache_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The run's prompt tokens looked up, hit on the device, reloaded from the tier; hit rates; decisions."""
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = diff.get("queries", 0.0)
    hits = diff.get("device_hits", 0.0) + diff.get("tier_hits", 0.0)
    return {"queried_tokens": int(queries), "device_hit_tokens": int(diff.get("device_hits", 0.0)),
            "tier_hit_tokens": int(diff.get("tier_hits", 0.0)),
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "device_hit_rate": diff.get("device_hits", 0.0) / queries if queries else 0.0,
            "routing_decisions": {k.removeprefix("decision:"): int(v) for k, v in diff.items()
                                  if k.startswith("decision:") and v},
            # Exact routing's predicted cached tokens checked against the engines' hits, per request.
            "predictions": {k.removeprefix("prediction:"): int(v) for k, v in diff.items()
                            if k.startswith("prediction:")}}


# --------------------------------------------------------------------------- the comparison


class Server(Protocol):
    url: str

    def stop(self, everything: bool = True) -> None: ...


def compare(arms: Sequence[PolicyRun], base_settings: dict[str, Any], offload_size: str,
            start: Callable[[dict[str, Any]], Server], measure: Callable[[Server, PolicyRun], dict[str, Any]],
            log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Each arm in turn: start its app, `measure` it (one run entry), delete the app (even when the run
    fails); the entries, each with its arm's `policy` and `offload` set."""
    entries = []
    for arm in arms:
        settings = arm_settings(base_settings, arm, offload_size)
        log(f"routing comparison: {arm.label} ({settings['routing_policy']}"
            f"{', offload tier ' + offload_size if arm.offload else ''})")
        server = start(settings)
        try:
            entry = measure(server, arm)
        finally:
            server.stop(everything=False)
        entries.append({**entry, "policy": arm.label, "offload": arm.offload})
    return entries


def figures(entry: dict[str, Any]) -> dict[str, float | None]:
    ttft = entry["latency_ms"].get("ttft") or {}
    return {"ttft_p50_ms": ttft.get("p50"), "ttft_p90_ms": ttft.get("p90"),
            "output_tokens_per_s": entry["throughput"]["output_tokens_per_s"],
            "prefix_hit_rate": entry["cache"]["prefix_hit_rate"]}


def summary(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-policy figures and the issue's aims (ratio, target, met) for the arms that ran."""
    by_label = {e["policy"]: figures(e) for e in entries}
    aims = {}
    for name, top, bottom, figure, target in AIMS:
        if top not in by_label or bottom not in by_label:
            continue
        a, b = by_label[top][figure], by_label[bottom][figure]
        ratio = None if a is None or b is None or not b else a / b
        aims[name] = {"ratio": ratio, "target": target, "met": ratio is not None and ratio >= target}
    return {"policies": by_label, "aims": aims}


def table(entries: Sequence[dict[str, Any]]) -> str:
    rows = []
    for e in entries:
        f, cache = figures(e), e["cache"]
        rows.append([e["policy"], f"{e['completed']}/{e['num_requests']}", f["ttft_p50_ms"], f["ttft_p90_ms"],
                     f["output_tokens_per_s"], f"{cache['prefix_hit_rate']:.1%}", f"{cache['device_hit_rate']:.1%}",
                     cache["tier_hit_tokens"], _predicted(cache.get("predictions") or {}),
                     " ".join(f"{k}={v}" for k, v in sorted(cache["routing_decisions"].items())) or "-"])
    return rep.table(["policy", "done", "TTFT p50 ms", "TTFT p90 ms", "out tok/s", "prefix hit", "device hit",
                      "tier tokens", "predicted exactly", "router decisions"], rows)


def _predicted(predictions: dict[str, int]) -> str:
    checked = predictions.get("match", 0) + predictions.get("mismatch", 0)
    return f"{predictions.get('match', 0)}/{checked}" if checked else "-"


def aims_lines(aims: dict[str, Any]) -> list[str]:
    lines = []
    for name, aim in aims.items():
        ratio = "-" if aim["ratio"] is None else f"{aim['ratio']:.2f}x"
        lines.append(f"  {name}: {ratio} (aim >= {aim['target']:g}x: {'met' if aim['met'] else 'not met'})")
    return lines
