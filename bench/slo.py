"""Latency targets (SLOs) and goodput: `--slo ttft:500ms,tpot:50ms`.

A request meets the SLO when every named metric is at or under its target: `ttft` (time to first
token), `tpot` (mean time per output token after the first), `itl` (its worst inter-token gap) and
`e2e` (end-to-end). Goodput is the rate of requests that meet it (requests/s over the run's
duration); `attainment` is their share of all requests sent (a failed request never meets it).
Over a sweep of request rates, `max_rate_meeting_slo` is the highest offered rate whose attainment
reaches the target share (`--slo-attainment`, 0.9 by default, as in DistServe's goodput).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
_TARGET = re.compile(r"^\s*([a-z0-9]+)\s*[:=]\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")


@dataclass(frozen=True)
class RequestLatency:
    """One request's measured latencies in seconds (None where it has none, e.g. TPOT of one token)."""

    ok: bool
    ttft: float | None = None
    tpot: float | None = None
    max_itl: float | None = None
    e2e: float | None = None

    def value(self, metric: str) -> float | None:
        return self.max_itl if metric == "itl" else getattr(self, metric)


def parse_slo(text: str) -> dict[str, float]:
    """"ttft:500ms,tpot:50ms" -> {"ttft": 0.5, "tpot": 0.05} (seconds; a bare number is ms).

    Raises ValueError naming the bad part."""
    if not text or not text.strip():
        raise ValueError("--slo: empty; expected e.g. ttft:500ms,tpot:50ms")
    targets: dict[str, float] = {}
    for part in text.split(","):
        match = _TARGET.match(part.lower())
        if not match:
            raise ValueError(f"--slo: cannot parse {part.strip()!r}; expected METRIC:VALUE[ms|s|us], "
                             f"e.g. ttft:500ms")
        metric, value, unit = match.groups()
        if metric not in SLO_METRICS:
            raise ValueError(f"--slo: unknown metric {metric!r}; one of {', '.join(SLO_METRICS)}")
        if metric in targets:
            raise ValueError(f"--slo: {metric} is given twice")
        seconds = float(value) * _UNITS[unit or "ms"]
        if not seconds > 0:
            raise ValueError(f"--slo: {metric} must be > 0, got {part.strip()!r}")
        targets[metric] = seconds
    return targets


def format_slo(targets: Mapping[str, float]) -> str:
    return ",".join(f"{k}:{v * 1e3:g}ms" for k, v in targets.items())


def meets_slo(request: RequestLatency, targets: Mapping[str, float]) -> bool:
    """True when the request succeeded and every targeted metric it has is within its target.
    A metric the request cannot have (TPOT or ITL of a one-token answer) does not count against it."""
    if not request.ok:
        return False
    for metric, limit in targets.items():
        value = request.value(metric)
        if value is not None and value > limit:
            return False
    return True


def goodput(requests: Iterable[RequestLatency], targets: Mapping[str, float], duration_s: float) -> dict:
    """{"requests_per_s", "good_requests", "attainment"} for one run of `duration_s` seconds."""
    requests = list(requests)
    if duration_s <= 0:
        raise ValueError(f"goodput: duration_s must be > 0, got {duration_s}")
    good = sum(meets_slo(r, targets) for r in requests)
    return {"requests_per_s": good / duration_s, "good_requests": good,
            "attainment": good / len(requests) if requests else 0.0}


def max_rate_meeting_slo(runs: Iterable[tuple[float, float]], min_attainment: float) -> float | None:
    """The highest offered rate (inf included) among (rate, attainment) pairs whose attainment reaches
    `min_attainment`, provided every lower rate does too (a sweep is read from the bottom up); None when
    even the lowest misses."""
    if not 0 < min_attainment <= 1:
        raise ValueError(f"--slo-attainment: must be in (0, 1], got {min_attainment}")
    best = None
    for rate, attainment in sorted(runs, key=lambda r: r[0]):
        if attainment + 1e-12 < min_attainment:
            break
        best = rate
    return best


def rate_label(rate: float) -> float | str:
    """JSON-friendly rate: "inf" for an unbounded one."""
    return "inf" if math.isinf(rate) else rate
