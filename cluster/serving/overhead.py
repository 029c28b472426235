"""Framework-overhead metrics: per engine request, the seconds spent in each stage of its path, and its
time to first token and time per output token split into "model" time (what the engine measured: its
queue and its steps) and "framework" time (the rest: ingress, routing, transport, output path).

Stages (`pagedserve:request_stage_seconds{stage=...}`):
  ingress      HTTP request received -> handed to the engine client (auth, validation, tokenization)
  router       the routing choices (their own duration)
  dispatch     handed to the engine client -> the (first) engine's arrival: routing and transport
  queue        the engine's arrival -> first scheduled (per engine leg: PD has two)
  prefill      first scheduled -> first token (per leg; a PD decode leg's includes its KV pull)
  kv_transfer  the KV pull of a PD decode leg (it overlaps that leg's prefill)
  decode       first token -> last token (per leg)
  output       the last engine's last token -> its last output at the ingress (detokenization, transport)

The split is computed from durations each measured inside one process (the ingress's TTFT minus the
engine's own arrival-to-first-token), so it needs no synchronised clocks; dispatch and output compare
wall clocks of two processes and are only as good as their clocks' agreement (same node: exact).
Labels: model_name, deployment (the engine deployment or PD pool) and replica (the engine chosen), from
the routing decisions: queue, prefill, kv_transfer and decode are observed once per engine leg with that
leg's own deployment and replica (a PD request: its prefill on the prefill replica, its KV pull and
decode on the decode replica; a migrated one: each engine it ran on), so their counts are legs, not
requests; ingress, router, dispatch and the TTFT split carry the first leg's (the engine that made the
first token), output and the TPOT split the last leg's. Empty where no router recorded a decision."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from pagedserve.cluster.serving.request_stages import RequestStages, leg_routes
from pagedserve.engine.outputs import RequestMetrics

PREFIX = "pagedserve:"
STAGES = ("ingress", "router", "dispatch", "queue", "prefill", "kv_transfer", "decode", "output")
LEG_STAGES = ("queue", "prefill", "kv_transfer", "decode")  # observed per engine leg, with the leg's labels
STAGE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 600.0)
TPOT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0, 2.5, 5.0)


class OverheadMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "deployment", "replica"]
        self.stage = Histogram(PREFIX + "request_stage_seconds", "Seconds one engine request spent in each stage "
                               "of its path (ingress, router, dispatch, queue, prefill, kv_transfer, decode, output).",
                               [*labels, "stage"], buckets=STAGE_BUCKETS, registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_split_seconds", "Time to first token, split into the "
                              "engine's own (part=model: its queue and prefill) and the rest (part=framework).",
                              [*labels, "part"], buckets=STAGE_BUCKETS, registry=registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_split_seconds", "Time per output token after the "
                              "first, split into the engine's own (part=model) and the rest (part=framework).",
                              [*labels, "part"], buckets=TPOT_BUCKETS, registry=registry)

    def observe(self, stages: RequestStages | None, legs: list[RequestMetrics], routes: list[dict],
                ttft_s: float | None, client_decode_s: float | None, num_tokens: int) -> dict[str, float]:
        """Observe one finished engine request; returns its stage seconds (what was known, legs summed)."""
        per_leg = [self._labels(r) for r in leg_routes(legs, routes)]
        first = per_leg[0] if per_leg else self._labels(routes[0] if routes else {})
        last = per_leg[-1] if per_leg else self._labels(routes[-1] if routes else {})
        seconds = stage_seconds(stages, legs, routes)
        for stage, value in seconds.items():
            if stage not in LEG_STAGES:
                self.stage.labels(*(last if stage == "output" else first), stage).observe(value)
        for leg, labels in zip(legs, per_leg):
            for stage, value in leg_stage_seconds(leg).items():
                self.stage.labels(*labels, stage).observe(value)
        if ttft_s is not None and legs and legs[0].first_token_time is not None:
            model = max(0.0, legs[0].first_token_time - legs[0].arrival_time)
            self.ttft.labels(*first, "model").observe(min(model, ttft_s))
            self.ttft.labels(*first, "framework").observe(max(0.0, ttft_s - model))
        if client_decode_s is not None and num_tokens > 1 and "decode" in seconds:
            # The engines' own time after the first token: every leg's decode, and a later leg's queue and
            # prefill (a PD decode leg's KV pull and continuation step, a migrated request's re-prefill).
            later = sum(_span(leg.arrival_time, leg.first_token_time) or 0.0 for leg in legs[1:])
            model = (seconds["decode"] + later) / (num_tokens - 1)
            client = client_decode_s / (num_tokens - 1)
            self.tpot.labels(*last, "model").observe(min(model, client))
            self.tpot.labels(*last, "framework").observe(max(0.0, client - model))
        return seconds

    def _labels(self, route: dict) -> tuple[str, str, str]:
        return self.model_name, str(route.get("deployment", "")), str(route.get("winner", ""))


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def leg_stage_seconds(leg: RequestMetrics) -> dict[str, float]:
    """One engine leg's queue, prefill, kv_transfer and decode seconds (those it has)."""
    out = {}
    for name, value in (("queue", _span(leg.arrival_time, leg.first_scheduled_time)),
                        ("prefill", _span(leg.first_scheduled_time, leg.first_token_time)),
                        ("decode", _span(leg.first_token_time, leg.last_token_time))):
        if value is not None:
            out[name] = value
    load = leg.timeline.kv_load if leg.timeline is not None else None
    if load is not None and load.end is not None:
        out["kv_transfer"] = max(0.0, load.end - load.start)
    return out


def stage_seconds(stages: RequestStages | None, legs: list[RequestMetrics], routes: list[dict]) -> dict[str, float]:
    """Each stage's seconds for one engine request (stages with nothing to measure are left out)."""
    out: dict[str, float] = {}
    if stages is not None:
        ingress = stages.between("received", "dispatched")
        if ingress is not None:
            out["ingress"] = ingress
    if routes:
        out["router"] = sum(float(r.get("seconds", 0.0)) for r in routes)
    if legs and stages is not None and "dispatched" in stages.marks:
        out["dispatch"] = max(0.0, legs[0].arrival_time - stages.marks["dispatched"])
    parts: dict[str, float] = {}
    for leg in legs:
        for name, value in leg_stage_seconds(leg).items():
            parts[name] = parts.get(name, 0.0) + value
    out.update(parts)
    if legs and stages is not None and "last_output" in stages.marks:
        last = legs[-1].last_token_time or legs[-1].finished_time
        if last is not None:
            out["output"] = max(0.0, stages.marks["last_output"] - last)
    return out
