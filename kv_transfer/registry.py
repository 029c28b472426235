"""Connector names -> the transport class that implements them, as import paths.

Resolved by name (like executor backends) so that `kv_transfer/` never imports Ray: the Ray transport
lives in `cluster/pd/` and is imported only when an engine is configured with it.
"""

from __future__ import annotations

import importlib

CONNECTORS: dict[str, str] = {
    # Same process (tests, two offline LLMs): reads are direct tensor copies.
    "inproc": "pagedserve.kv_transfer.connectors.inproc:InProcessTransport",
    # torch.distributed point-to-point between a producer rank and a consumer rank (gloo / NCCL).
    "torch_p2p": "pagedserve.kv_transfer.connectors.torch_p2p:TorchP2PTransport",
    # Across Ray nodes: reads are actor calls, tensors move through Ray's object store.
    "ray": "pagedserve.cluster.pd.ray_transport:RayTransport",
}


def transport_class(name: str) -> type:
    try:
        path = CONNECTORS[name]
    except KeyError:
        raise ValueError(f"kv_connector: unknown connector {name!r}; choose one of {sorted(CONNECTORS)}") from None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
