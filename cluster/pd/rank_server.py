"""The producer side of the Ray transport: one rank's KV read out for a reader in another process.

A rank that serves KV lives in a Ray actor: the engine actor itself (an in-process worker) or a
worker-group rank actor. Those actors answer `kv_read` by calling `read_layers` here with their
worker. The address a reader holds carries the serving transport's token: a restarted actor (new
token) refuses reads meant for its previous incarnation, whose blocks it never had.

Order of the checks, cheapest and least trusting first, before anything is gathered: the serving
token, the read's signature (cluster/pd/read_auth.py: only the deployment's members read), the spec
against this rank's layout, then the hold (its token, deadline and tokens: KVSource.open).
"""

from __future__ import annotations

import hmac
from typing import Any

import torch

from pagedserve.kv_transfer.holds import shown
from pagedserve.kv_transfer.kv_source import ReadRefused, ReadSpec


def connector_of(worker: Any) -> Any:
    """The worker half of the worker's KV connector (kv_transfer.worker_connector.PDConnectorWorker)."""
    runner = getattr(worker, "model_runner", None)
    hooks = getattr(runner, "kv_hooks", None)
    if hooks is None or getattr(hooks, "source", None) is None:
        raise ConnectionError("this rank serves no KV (it is not a KV producer, or its KV cache is not ready)")
    return hooks


def read_layers(worker: Any, token: str, spec: ReadSpec, layers: list[int],
                auth: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V of each layer in `layers` for `spec`, as CPU tensors (they cross processes and nodes)."""
    hooks = connector_of(worker)
    transport = hooks.transport
    serving = getattr(transport, "token", None)
    if not isinstance(token, str) or serving is None or not hmac.compare_digest(serving.encode(), token.encode()):
        raise ConnectionError(f"read of hold {shown(getattr(spec, 'remote_request_id', None))}: this producer rank "
                              "restarted since the request was prefilled; its KV is gone")
    transport.verifier.verify(auth, token, spec, layers)
    source = hooks.source
    source.check_request(spec)
    if not layers or any(layer not in spec.layers for layer in layers):
        raise ReadRefused(f"read of hold {spec.remote_request_id!r}: layers {str(layers)[:100]} are not part of "
                          f"the read of {spec.layers}")
    read = source.open(spec)
    out = []
    for layer in layers:
        k, v = source.read_layer(spec, layer, read)
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


def read_local(engine: Any, rank: int, token: str, spec: ReadSpec, layers: list[int], auth: Any) -> list:
    """`read_layers` for a rank whose worker runs in this process (an in-process executor)."""
    worker = getattr(_executor(engine), "worker", None)
    if worker is None or rank != 0:
        raise ConnectionError(f"rank {rank!r} of this engine does not run in the engine actor's process")
    return read_layers(worker, token, spec, layers, auth)
