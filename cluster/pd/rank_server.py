"""Where a PD consumer sends the `kv_read` of one producer rank (the Ray transport's addressing).

A rank that serves KV lives in a Ray actor: the engine host itself (an in-process worker) or a
worker-group rank actor. Either answers `kv_read` with its worker's `Worker.kv_read`
(kv_transfer/rank_read.py holds the checks: serving token, signature, spec, hold).
"""

from __future__ import annotations

from typing import Any

from pagedserve.kv_transfer.kv_source import ReadSpec


def rank_actors(executor: Any, world_size: int) -> list:
    """Per rank of an engine (given its executor): its worker-group rank actor, or None when the worker
    runs in this process (the engine host answers `kv_read` for it)."""
    group = getattr(executor, "group", None)
    if group is None:
        return [None] * world_size
    return list(group.actors)


def read_local(executor: Any, rank: int, token: str, spec: ReadSpec, layers: list[int], auth: Any) -> list:
    """`Worker.kv_read` for a rank whose worker runs in this process (an in-process executor)."""
    worker = getattr(executor, "worker", None)
    if worker is None or rank != 0:
        raise ConnectionError(f"rank {rank!r} of this engine does not run in the engine host's process")
    return worker.kv_read(token, spec, layers, auth)
