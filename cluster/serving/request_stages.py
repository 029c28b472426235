"""Where one HTTP request's time went, as it goes: wall-clock marks of the ingress stages, the engine
legs' own records (`RequestMetrics`, with their prefill chunks and KV pulls), the routing decisions and
any retry or migration. Plain data, kept for every inference request whether tracing is on or not:
the overhead histograms (overhead.py) and the trace (tracing.py) are both built from it at the end.

Marks: received, auth, tokenize_start, tokenize_end, dispatched, first_output, last_output, responded.
Events: retries and migrations (`record_event`, from migration.py and the PD client), at most MAX_EVENTS.
Reached from anywhere in the request's task through a context variable (`current_stages()`)."""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.outputs import RequestMetrics, RequestOutput

# Retries and migrations kept per request (each is bounded by its own limit too: max_migrations, ...).
MAX_EVENTS = 16

_current: ContextVar[RequestStages | None] = ContextVar("pagedserve_request_stages", default=None)


@dataclass
class StageEvent:
    """Something that happened once: a retry on another engine, a migration (name, wall time, attributes).
    `end`, when its recorder sets it, is when the request was resubmitted (after any backoff): the trace
    then shows it as a span from the failure to the new routing decision, with that decision inside."""

    name: str
    time: float
    attributes: dict[str, Any] = field(default_factory=dict)
    end: float | None = None


@dataclass
class RequestStages:
    method: str = "POST"
    path: str = ""
    marks: dict[str, float] = field(default_factory=lambda: {"received": time.time()})
    # The engines that served it, by their engine-side arrival time (PD: the prefill leg, then the decode leg).
    legs: dict[float, RequestMetrics] = field(default_factory=dict)
    routes: list[dict] = field(default_factory=list)
    events: list[StageEvent] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    streamed: bool = False
    status: int | None = None
    trace_id: str | None = None  # with tracing on: the trace's id (response headers, error bodies)

    def mark(self, name: str, when: float | None = None, first: bool = False) -> None:
        """Record `name` now (or at `when`); with `first`, keep an earlier record of it."""
        if not (first and name in self.marks):
            self.marks[name] = time.time() if when is None else when

    def event(self, name: str, **attributes: Any) -> StageEvent | None:
        """The hook for retries and migrations: an event on the request's trace (at most MAX_EVENTS per
        request, then None: a trace stays bounded however often a request is retried)."""
        if len(self.events) >= MAX_EVENTS:
            return None
        event = StageEvent(name, time.time(), attributes)
        self.events.append(event)
        return event

    def on_output(self, output: RequestOutput) -> None:
        now = time.time()
        self.mark("first_output", now, first=True)
        self.mark("last_output", now)
        self.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        m = output.metrics
        if m is not None:
            self.legs[m.arrival_time] = m

    def ordered_legs(self) -> list[RequestMetrics]:
        return [self.legs[k] for k in sorted(self.legs)]

    def between(self, start: str, end: str) -> float | None:
        """Seconds from mark `start` to mark `end` (None when either is missing; never negative)."""
        if start not in self.marks or end not in self.marks:
            return None
        return max(0.0, self.marks[end] - self.marks[start])


def leg_routes(legs: list[RequestMetrics], routes: list[dict]) -> list[dict]:
    """The routing decision that sent each engine leg (ordered by arrival) where it went: the last one made
    before the leg's arrival (PD: the prefill pool's, then the decode pool's; a migration: the first try's,
    then the resubmission's), else the first ({} when none was recorded). Routes are dated on the ingress's
    clock, arrivals on the engine's: as exact as the two agree (same node: exactly)."""
    ordered = sorted(routes, key=lambda r: float(r.get("start", 0.0)))
    out = []
    for leg in legs:
        before = [r for r in ordered if float(r.get("start", 0.0)) <= leg.arrival_time]
        out.append(before[-1] if before else (ordered[0] if ordered else {}))
    return out


def begin_request(method: str, path: str) -> tuple[RequestStages, Any]:
    """A fresh record for this request's context; returns it and the token for `end_request`."""
    stages = RequestStages(method, path)
    return stages, _current.set(stages)


def end_request(token: Any) -> None:
    _current.reset(token)


def current_stages() -> RequestStages | None:
    return _current.get()


def record_event(name: str, **attributes: Any) -> StageEvent | None:
    """An event (retry, migration) on the current request's trace; None outside a request (offline use)."""
    stages = _current.get()
    return None if stages is None else stages.event(name, **attributes)


def mark(name: str, first: bool = False) -> None:
    """Mark a stage of the current request (a no-op outside one); with `first`, keep an earlier mark."""
    stages = _current.get()
    if stages is not None:
        stages.mark(name, first=first)
