"""How a failure reaches the request it ends: one line naming the exception, the `error` its output
carries (the sampler's rows, the runner's per-request work and the engine core's failed batches all
report it so)."""

from __future__ import annotations


def describe_failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
