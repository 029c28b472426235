"""Why each recent request went where it went, kept briefly for the request's trace.

A router (the Serve request router, the in-process coordinator) records its decision for a request id:
the candidates and their loads, the winner, the kind of decision and how long the choice took. The
ingress serving that request takes the record when the request ends (the engine client's `routing_records`)
and puts it on the trace's routing span and into the overhead histograms. Bounded: records nobody
takes (a router in another process, tracing and metrics never asking) fall out oldest first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_RECORDS = 4096
MAX_PER_REQUEST = 8
MAX_CANDIDATES = 8  # loads of at most this many candidates are kept (the winner's always)


@dataclass
class RouteRecord:
    winner: str
    decision: str  # routing_policy's kinds: prefix_affine, prefix_fallback, balanced, single
    deployment: str = ""
    candidates: dict[str, float] = field(default_factory=dict)  # candidate -> load when chosen
    num_candidates: int = 0
    start: float = 0.0  # wall clock
    seconds: float = 0.0  # the choice itself

    def as_dict(self) -> dict[str, Any]:
        return {"winner": self.winner, "decision": self.decision, "deployment": self.deployment,
                "candidates": dict(self.candidates), "num_candidates": self.num_candidates,
                "start": self.start, "seconds": self.seconds}


class RouteLog:
    """request id -> its RouteRecords (a retry routes again: at most MAX_PER_REQUEST kept), for the newest
    MAX_RECORDS requests (thread safe: Serve routers and the ingress's event loop may sit on different
    threads)."""

    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self.max_records = max_records
        self._records: OrderedDict[str, list[RouteRecord]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, request_id: str, record: RouteRecord) -> None:
        with self._lock:
            records = self._records.setdefault(request_id, [])
            if len(records) < MAX_PER_REQUEST:
                records.append(record)
            self._records.move_to_end(request_id)
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def take(self, request_id: str) -> list[RouteRecord]:
        with self._lock:
            return self._records.pop(request_id, [])


def timed_choice(choose: Callable[[], tuple[Any, str]], candidates: Iterable[Hashable],
                 load: Callable[[Any], float], deployment: str = "",
                 name: Callable[[Any], str] = str) -> tuple[Any, RouteRecord]:
    """Run a routing choice and describe it: (its choice, the record naming candidates by `name`)."""
    start, began = time.time(), time.perf_counter()
    choice, decision = choose()
    seconds = time.perf_counter() - began
    listed = list(candidates)
    shown = [c for c in listed[:MAX_CANDIDATES] if c != choice] + [choice]
    return choice, RouteRecord(name(choice), decision, deployment, {name(c): float(load(c)) for c in shown},
                               len(listed), start, seconds)
