"""Speculative-decoding counters across engines: each engine reports its own cumulative
`SchedulerStats.spec_decoding` (`engine.spec_decode.metrics.SpecDecodeStats.as_dict()`, `{}` when it
does not speculate); the coordinator, the Serve engine client and the PD client sum them here for
/metrics. An engine that restarts counts from zero again, so its callers keep the figures of earlier
incarnations (or replicas) and add them, as they do for the other cumulative counters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedserve.engine.spec_decode.metrics import SpecDecodeStats


def spec_from_dict(figures: dict[str, Any] | None) -> SpecDecodeStats | None:
    """An engine's reported counters, or None when it does not speculate (reported `{}` or nothing)."""
    if not figures:
        return None
    return SpecDecodeStats(
        num_drafts=int(figures.get("num_drafts", 0)),
        num_draft_tokens=int(figures.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(figures.get("num_accepted_tokens", 0)),
        accepted_per_position=[int(n) for n in figures.get("accepted_per_position", ())],
    )


def sum_spec(parts: Iterable[SpecDecodeStats | dict[str, Any] | None]) -> dict[str, Any] | None:
    """The summed counters as `SpecDecodeStats.as_dict()` (rates recomputed from the sums), or None when
    no part speculates, so that /metrics shows spec_decode_* only for a speculating deployment."""
    total: SpecDecodeStats | None = None
    for part in parts:
        stats = spec_from_dict(part) if isinstance(part, dict) or part is None else part
        if stats is None:
            continue
        if total is None:
            total = SpecDecodeStats()
        total.merge(stats)
    return None if total is None else total.as_dict()
