"""The producer side of a cross-process KV read: one rank's KV read out for a reader in another process.

The worker answers it (`Worker.kv_read`, reached through the executor: a rank actor's `kv_read`, or
the engine host's for an in-process worker) with its KV connector's worker half. The address a reader
holds carries the serving transport's token: a restarted rank (new token) refuses reads meant for its
previous incarnation, whose blocks it never had.

Order of the checks, cheapest and least trusting first, before anything is gathered: the serving
token, the read's signature (the transport's verifier: only the deployment's members read), the spec
against this rank's layout, then the hold (its token, deadline and tokens: KVSource.open).
"""

from __future__ import annotations

import hmac
from typing import Any

import torch

from pagedserve.kv_transfer.holds import shown
from pagedserve.kv_transfer.kv_source import ReadRefused, ReadSpec


def read_layers(hooks: Any, token: str, spec: ReadSpec, layers: list[int],
                auth: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V of each layer in `layers` for `spec`, as CPU tensors (they cross processes and nodes).

    `hooks` is the worker half of the rank's KV connector (kv_transfer.worker_connector.PDConnectorWorker)."""
    if hooks is None or getattr(hooks, "source", None) is None:
        raise ConnectionError("this rank serves no KV (it is not a KV producer, or its KV cache is not ready)")
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
