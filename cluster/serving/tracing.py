"""Per-request tracing with OpenTelemetry, an optional dependency (`pip install pagedserve[otel]`).

Off unless `otlp_traces_endpoint` is set (`--otlp-traces-endpoint`) or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` is; off, this module imports
nothing of OpenTelemetry and a request pays for nothing but its `RequestStages` marks. On, each inference
request is one trace (continuing the client's W3C `traceparent`): a root server span opened when the
request arrives (its id goes into the response headers and error bodies at once), and, when the
response is done, its children built from the request's `RequestStages` with their recorded times:

  ingress (auth, validate, tokenize, prepare) -> dispatch (route: candidates, loads, winner, why)
  -> engine, one per leg (queue, prefill with one span per chunk, kv_transfer, decode) -> output

and for each retry or migration (migration.py, the PD client) an event on the root span; a resubmission
(migration, overload_retry) is also a span from the failure to its new routing decision (inside it).

The engines never import OpenTelemetry: their times come back inside `RequestOutput.metrics`, so no
context crosses a process. The SDK reads the other OTEL_* variables itself (service name, resource
attributes, exporter headers, timeouts); `trace_sample_ratio` (else OTEL_TRACES_SAMPLER_ARG, else 1)
samples new traces, and a client's sampled flag is followed (parent-based)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.serving.request_stages import RequestStages, leg_routes

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACE_ID_HEADER = "x-trace-id"
MAX_CANDIDATES_SHOWN = 8


def tracing_requested(endpoint: str | None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint) or any(os.environ.get(name) for name in ENDPOINT_ENV)


def sample_ratio(ratio: float | None) -> float:
    if ratio is not None:
        return ratio
    try:
        return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        return 1.0


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class RequestSpan:
    """The open root span of one request."""

    span: Any
    trace_id: str
    traceparent: str


class Tracing:
    """A tracer provider of this app's own (never the process-global one: two apps in one process, or
    a host application's own tracing, stay apart) and the spans of each request."""

    def __init__(self, endpoint: str | None = None, ratio: float | None = None, exporter: Any = None,
                 service_name: str = "pagedserve") -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ValueError("otlp_traces_endpoint: tracing needs OpenTelemetry (pip install pagedserve[otel])") from None
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio(ratio))))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
        else:  # tests: an in-memory exporter, spans handed over as they end
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pagedserve.serving")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_args(cls, args: Any) -> Tracing | None:
        """None (and nothing imported) unless tracing was asked for."""
        endpoint = getattr(args, "otlp_traces_endpoint", None)
        if not tracing_requested(endpoint):
            return None
        return cls(endpoint, getattr(args, "trace_sample_ratio", None))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export what is batched now (the app calls it as it stops); False if that timed out."""
        return self.provider.force_flush(timeout_millis=int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()

    # ------------------------------------------------------------------ one request

    def start(self, headers: dict[str, str], stages: RequestStages) -> RequestSpan:
        from opentelemetry import trace

        parent = self.propagator.extract(carrier=headers)
        span = self.tracer.start_span(f"{stages.method} {stages.path}", context=parent, kind=trace.SpanKind.SERVER,
                                      start_time=_ns(stages.marks["received"]),
                                      attributes={"http.request.method": stages.method, "url.path": stages.path})
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        ctx = span.get_span_context()
        return RequestSpan(span, format(ctx.trace_id, "032x"), carrier.get("traceparent", ""))

    def finish(self, root: RequestSpan, stages: RequestStages, request_id: str | None) -> None:
        """Build the request's child spans from its stages and end the root span."""
        from opentelemetry import trace

        span = root.span
        end = stages.marks.get("responded") or stages.marks.get("last_output") or stages.marks["received"]
        if span.is_recording():
            if request_id is not None:
                span.set_attribute("pagedserve.request_id", request_id)
            if stages.status is not None:
                span.set_attribute("http.response.status_code", stages.status)
                if stages.status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
            span.set_attribute("pagedserve.prompt_tokens", stages.num_prompt_tokens)
            span.set_attribute("pagedserve.output_tokens", stages.num_output_tokens)
            span.set_attribute("pagedserve.streamed", stages.streamed)
            if "first_output" in stages.marks:  # the first token reached the ingress (TTFT as it streams out)
                span.add_event("first_output", timestamp=_ns(stages.marks["first_output"]))
            for event in stages.events:  # retries, migrations
                span.add_event(event.name, attributes=_event_attributes(event.attributes),
                               timestamp=_ns(event.time))
            _Children(self.tracer, trace.set_span_in_context(span), stages).build()
        span.end(end_time=_ns(end))


class _Children:
    def __init__(self, tracer: Any, root_ctx: Any, stages: RequestStages) -> None:
        self.tracer, self.root_ctx, self.stages, self.m = tracer, root_ctx, stages, stages.marks

    def span(self, name: str, start: float | None, end: float | None, parent: Any = None,
             attributes: dict | None = None) -> Any:
        """An ended child span [start, end] (None when either is unknown)."""
        if start is None or end is None:
            return None
        span = self.tracer.start_span(name, context=parent or self.root_ctx, start_time=_ns(start),
                                      attributes=attributes or {})
        span.end(end_time=_ns(max(start, end)))
        return span

    def build(self) -> None:
        from opentelemetry import trace

        m, stages = self.m, self.stages
        dispatched = m.get("dispatched")
        ingress = self.span("ingress", m["received"], dispatched)
        if ingress is not None:
            ctx = trace.set_span_in_context(ingress)
            auth = m.get("auth", m["received"])
            self.span("auth", m["received"], auth, ctx)
            self.span("validate", auth, m.get("tokenize_start", dispatched), ctx)
            self.span("tokenize", m.get("tokenize_start"), m.get("tokenize_end"), ctx,
                      {"pagedserve.prompt_tokens": stages.num_prompt_tokens})
            self.span("prepare", m.get("tokenize_end", auth), dispatched, ctx)
        legs = stages.ordered_legs()
        # Each routing decision under the hand-over of the first leg to arrive after it (PD: the prefill's,
        # then the decode's); a resubmission's sit in its retry span instead.
        by_leg: dict[int, list[dict]] = {}
        for route in sorted((r for r in stages.routes if not r.get("attempt")), key=lambda r: r["start"]):
            index = next((i for i, leg in enumerate(legs) if leg.arrival_time >= route["start"]), len(legs) - 1)
            by_leg.setdefault(index, []).append(route)
        for index, (leg, leg_route) in enumerate(zip(legs, leg_routes(legs, stages.routes))):
            # Handed on to this leg's engine (PD: the decode leg after the prefill leg), its routing inside.
            routes = by_leg.get(index, [])[:4]
            # A later leg is handed on once the one before ended (its output back at the ingress, then routed
            # on); legs that ran side by side (a batch of prompts) start their hand-over at their arrival.
            previous = (legs[index - 1].finished_time or legs[index - 1].last_token_time) if index else None
            handed = leg.arrival_time if previous is None else min(previous, leg.arrival_time)
            base = dispatched if index == 0 else handed
            start = min([r["start"] for r in routes] + ([] if base is None else [base]), default=None)
            dispatch = self.span("dispatch", start, leg.arrival_time, None, {"pagedserve.leg": index})
            if dispatch is not None:
                ctx = trace.set_span_in_context(dispatch)
                for route in routes:
                    self.span("route", route["start"], route["start"] + route["seconds"], ctx, route_attributes(route))
            self.engine_leg(index, leg, leg_route)
        self.retries()
        if legs:
            last = legs[-1].last_token_time or legs[-1].finished_time
            self.span("output", last, m.get("responded", m.get("last_output")), None,
                      {"pagedserve.streamed": stages.streamed})

    def retries(self) -> None:
        """A span per resubmission (failure -> resubmitted, and its new routing decisions inside it)."""
        from opentelemetry import trace

        for event in self.stages.events:
            if event.end is None:
                continue
            attempt = event.attributes.get("pagedserve.retry.attempt")
            routes = [r for r in self.stages.routes if attempt is not None and r.get("attempt") == attempt][:4]
            end = max([event.end] + [r["start"] + r["seconds"] for r in routes])
            span = self.span(event.name, event.time, end, None, _event_attributes(event.attributes))
            ctx = trace.set_span_in_context(span)
            for route in routes:
                self.span("route", route["start"], route["start"] + route["seconds"], ctx, route_attributes(route))

    def engine_leg(self, index: int, leg: Any, route: dict) -> None:
        from opentelemetry import trace

        end = leg.finished_time or leg.last_token_time
        engine = self.span("engine", leg.arrival_time, end, None, {
            "pagedserve.leg": index, "pagedserve.deployment": str(route.get("deployment", "")),
            "pagedserve.replica": str(route.get("winner", "")), "pagedserve.cached_tokens": leg.num_cached_tokens,
            "pagedserve.preemptions": leg.num_preemptions})
        if engine is None:
            return
        ctx = trace.set_span_in_context(engine)
        self.span("queue", leg.arrival_time, leg.first_scheduled_time, ctx)
        timeline = leg.timeline
        prefill = self.span("prefill", leg.first_scheduled_time, leg.first_token_time, ctx, {
            "pagedserve.chunks": timeline.num_chunks if timeline is not None else 0})
        if prefill is not None and timeline is not None:
            chunk_ctx = trace.set_span_in_context(prefill)
            for i, chunk in enumerate(timeline.chunks):
                self.span("prefill_chunk", chunk.start, chunk.end, chunk_ctx,
                          {"pagedserve.chunk": i, "pagedserve.tokens": chunk.num_tokens})
        load = timeline.kv_load if timeline is not None else None
        if load is not None:
            self.span("kv_transfer", load.start, load.end, ctx, {
                "pagedserve.kv.bytes": load.num_bytes, "pagedserve.kv.tokens": load.num_tokens,
                "pagedserve.kv.ok": bool(load.ok), "pagedserve.kv.transport": load.transport,
                "pagedserve.kv.layers": load.num_layers})
        self.span("decode", leg.first_token_time, leg.last_token_time, ctx)


def _event_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Span attributes take str, bool, int, float (or lists of one): anything else as its text."""
    return {k: v if isinstance(v, (str, bool, int, float)) else str(v) for k, v in attributes.items()}


def route_attributes(route: dict) -> dict[str, Any]:
    candidates = sorted(route.get("candidates", {}).items())[:MAX_CANDIDATES_SHOWN]
    return {"pagedserve.route.decision": str(route.get("decision", "")),
            "pagedserve.route.winner": str(route.get("winner", "")),
            "pagedserve.route.deployment": str(route.get("deployment", "")),
            "pagedserve.route.num_candidates": int(route.get("num_candidates", 0)),
            "pagedserve.route.attempt": int(route.get("attempt", 0)),
            "pagedserve.route.candidates": [f"{name}={load:.3g}" for name, load in candidates]}
