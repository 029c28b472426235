"""`pagedserve bench serve`'s overhead split: where the served requests' time went, from the server's own
overhead histograms (cluster/serving/overhead.py), read from /metrics before and after each run.

Why /metrics and not per-request response headers: the split's parts are measured on the server (the
engine's queue and steps, the ingress, the output path), and a streamed response's headers leave before
its first token exists, so headers could not carry its TTFT split; the histograms' sums and counts over
the run give exact means for the run's requests (when the benchmark is the server's only client), from
any client, with no change to responses."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.serving.overhead import STAGES

STAGE = "pagedserve:request_stage_seconds"
TTFT_SPLIT = "pagedserve:time_to_first_token_split_seconds"
TPOT_SPLIT = "pagedserve:time_per_output_token_split_seconds"

# (sample name, label) -> summed value over every other label
Scrape = dict[tuple[str, str], float]


def parse(text: str) -> Scrape:
    """Sums and counts of the overhead histograms, by stage or part."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (STAGE, TTFT_SPLIT, TPOT_SPLIT):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                key = (sample.name, sample.labels.get("stage") or sample.labels.get("part", ""))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def scrape(base_url: str, headers: dict[str, str], timeout: float) -> Scrape | None:
    """The server's overhead histograms now; None when its /metrics cannot be read."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse(response.text)


def _means_ms(before: Scrape, after: Scrape, family: str, per: float | None = None) -> dict[str, float]:
    """Mean milliseconds of each label's observations over the run, or of its total over `per` requests."""
    means = {}
    for (name, label), count in after.items():
        if name != family + "_count":
            continue
        n = count - before.get((name, label), 0.0)
        if n > 0:
            total = after.get((family + "_sum", label), 0.0) - before.get((family + "_sum", label), 0.0)
            means[label] = 1e3 * total / (per or n)
    return means


def overhead_delta(before: Scrape | None, after: Scrape | None) -> dict[str, Any] | None:
    """The run's mean milliseconds per request by stage, and TTFT / TPOT split into framework and model,
    with the framework's share; None when the server has no overhead histograms (or no /metrics).

    Per request: the engine stages are observed once per engine leg (a PD request has two), so each
    stage's total is divided by the run's requests (its `ingress` observations, one per engine request)
    where the server reports them, else by the stage's own observations."""
    if before is None or after is None:
        return None
    key = (STAGE + "_count", "ingress")
    requests = after.get(key, 0.0) - before.get(key, 0.0)
    stages = _means_ms(before, after, STAGE, requests if requests > 0 else None)
    if not stages:
        return None
    out: dict[str, Any] = {"stage_ms": stages}
    for key, family in (("ttft_ms", TTFT_SPLIT), ("tpot_ms", TPOT_SPLIT)):
        parts = _means_ms(before, after, family)
        if "framework" in parts and "model" in parts:
            total = parts["framework"] + parts["model"]
            out[key] = {**parts, "framework_share": parts["framework"] / total if total > 0 else 0.0}
    return out


def overhead_table(runs: list[dict[str, Any]]) -> str:
    """One line per run: the TTFT and TPOT splits, then the mean milliseconds of each stage."""
    lines = []
    for run in runs:
        split = run.get("overhead")
        if not split:
            continue
        parts = []
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
            s = split.get(key)
            if s:
                parts.append(f"{label} {s['model'] + s['framework']:.2f} ms = model {s['model']:.2f} + framework "
                             f"{s['framework']:.2f} ({s['framework_share']:.0%})")
        order = {stage: i for i, stage in enumerate(STAGES)}  # the request's path, whatever the scrape's order
        ordered = sorted(split["stage_ms"].items(), key=lambda item: order.get(item[0], len(order)))
        stages = ", ".join(f"{k} {v:.2f}" for k, v in ordered)
        lines.append(f"{run['name']}: " + "; ".join(parts) + f"\n  mean ms per request by stage: {stages}")
    return "overhead split (server's /metrics):\n" + "\n".join(lines) if lines else ""
