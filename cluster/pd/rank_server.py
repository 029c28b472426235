"""The producer side of the Ray transport: one rank's KV read out for a reader in another process.

A rank that serves KV lives in a Ray actor: the engine actor itself (an in-process worker) or a
worker-group rank actor. Those actors answer `kv_read` by calling `read_layers` here with their
worker. The address a reader holds carries the serving transport's token: a restarted actor (new
token) refuses reads meant for its previous incarnation, whose blocks it never had.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.kv_transfer.kv_source import ReadSpec


def connector_of(worker: Any) -> Any:
    """The worker half of the worker's KV connector (kv_transfer.worker_connector.PDConnectorWorker)."""
    runner = getattr(worker, "model_runner", None)
    hooks = getattr(runner, "kv_hooks", None)
    if hooks is None or getattr(hooks, "source", None) is None:
        raise ConnectionError("this rank serves no KV (it is not a KV producer, or its KV cache is not ready)")
    return hooks


def read_layers(worker: Any, token: str, spec: ReadSpec, layers: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V of each layer in `layers` for `spec`, as CPU tensors (they cross processes and nodes)."""
    hooks = connector_of(worker)
    if getattr(hooks.transport, "token", None) != token:
        raise ConnectionError(f"request {spec.remote_request_id}: this producer rank restarted since the "
                              "request was prefilled; its KV is gone")
    source = hooks.source
    slots = source.slots(spec)
    out = []
    for layer in layers:
        k, v = source.read_layer(spec, layer, slots)
        out.append((k.cpu(), v.cpu()))
    return out


def _executor(engine: Any) -> Any:
    """The executor of an AsyncLLM's engine core."""
    return engine.engine.engine_core.executor


def rank_actors(engine: Any) -> list:
    """Per rank of an AsyncLLM's engine: its worker-group rank actor, or None when the worker runs in
    this process (the engine actor answers `kv_read` for it)."""
    executor = _executor(engine)
    group = getattr(executor, "group", None)
    if group is None:
        return [None] * engine.config.world_size
    return list(group.actors)


def read_local(engine: Any, rank: int, token: str, spec: ReadSpec, layers: list[int]) -> list:
    """`read_layers` for a rank whose worker runs in this process (an in-process executor)."""
    worker = getattr(_executor(engine), "worker", None)
    if worker is None or rank != 0:
        raise ConnectionError(f"rank {rank} of this engine does not run in the engine actor's process")
    return read_layers(worker, token, spec, layers)
