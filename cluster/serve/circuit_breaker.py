"""A circuit breaker per engine replica: an engine that fails several requests in a row leaves routing
until its health recovers.

The engine client reports each request's outcome (`record`): a failure is the engine's, not the
request's (the replica died under it, or the engine ended it with an error); bad input and refusals
for load are neither. `failure_threshold` failures in a row open the replica's circuit: the router
stops choosing it (unless every replica is open: then it routes as if none were). The circuit closes
when a routing-stats report that arrived after `cooldown_s` says the engine is healthy; it closes on
probation: one more failure opens it again at once.

A refusal for load (the engine's queue is full: `EngineOverloadedError`) is no failure, but the replica
that refused is passed over for `refusal_holdoff_s` (`refused`), so that the retry of the refused request,
and the requests routed meanwhile, go to another replica: without it a replica that looks idle to the
router (its queue filled by callers the router does not see, or stats older than the burst) or that
holds the request's prefix would be chosen again and refuse again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_COOLDOWN_S = 5.0
DEFAULT_REFUSAL_HOLDOFF_S = 1.0


@dataclass
class _Open:
    since: float
    stats_token: object  # the replica's last routing-stats report seen before the cooldown ended


@dataclass
class CircuitBreaker(Generic[K]):
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    cooldown_s: float = DEFAULT_COOLDOWN_S
    clock: Callable[[], float] = time.monotonic
    refusal_holdoff_s: float = DEFAULT_REFUSAL_HOLDOFF_S
    num_opens: int = 0  # circuits opened, ever (counted on /metrics)
    _failures: dict[K, int] = field(default_factory=dict)  # failures in a row
    _open: dict[K, _Open] = field(default_factory=dict)
    _stats_token: dict[K, object] = field(default_factory=dict)  # latest report seen, per replica
    _refused_until: dict[K, float] = field(default_factory=dict)  # replica -> end of its refusal hold-off

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold: expected >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s: expected >= 0, got {self.cooldown_s}")
        if self.refusal_holdoff_s < 0:
            raise ValueError(f"refusal_holdoff_s: expected >= 0, got {self.refusal_holdoff_s}")

    def record(self, key: K, ok: bool) -> None:
        """One request's outcome on `key`'s engine."""
        if ok:
            self._failures[key] = 0
            return
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        if failures >= self.failure_threshold and key not in self._open:
            self._open[key] = _Open(self.clock(), self._stats_token.get(key))
            self.num_opens += 1

    def observe(self, key: K, stats_token: object, healthy: bool) -> None:
        """The replica's latest routing-stats report (any object that changes with every report) and its
        health verdict: closes an open circuit on a healthy report that arrived after the cooldown."""
        self._stats_token[key] = stats_token
        opened = self._open.get(key)
        if opened is None:
            return
        if self.clock() - opened.since < self.cooldown_s:
            opened.stats_token = stats_token  # reports during the cooldown do not count
        elif healthy and stats_token is not opened.stats_token:
            del self._open[key]
            self._failures[key] = self.failure_threshold - 1  # probation

    def refused(self, key: K) -> None:
        """`key`'s engine refused a request for load: pass it over for `refusal_holdoff_s`."""
        self._refused_until[key] = self.clock() + self.refusal_holdoff_s

    def is_open(self, key: K) -> bool:
        return key in self._open

    def is_refusing(self, key: K) -> bool:
        """Within the hold-off after `key`'s engine refused a request for load."""
        until = self._refused_until.get(key)
        if until is None:
            return False
        if self.clock() >= until:
            del self._refused_until[key]
            return False
        return True

    def is_routable(self, key: K) -> bool:
        """Neither open nor refusing: the router may choose it (when some replica is)."""
        return not self.is_open(key) and not self.is_refusing(key)

    def num_open(self) -> int:
        return len(self._open)

    def forget(self, key: K) -> None:
        """A replica that left: nothing of it is kept."""
        self._failures.pop(key, None)
        self._open.pop(key, None)
        self._stats_token.pop(key, None)
        self._refused_until.pop(key, None)
