"""In-process transport: producer and consumer engines in one process (tests, two offline LLMs).

A producer rank registers its source under a key in a process-wide table; a read is a direct
gather from the producer's cache. The table is the point of this transport (engines in one process
find each other through it), keyed by engine id and rank so engines never see each other's state
by accident.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.transport import KVTransport, LayerReader

_SOURCES: dict[tuple[str, int], KVSource] = {}
_LOCK = threading.Lock()


class _DirectReader(LayerReader):
    def __init__(self, source: KVSource, spec: ReadSpec) -> None:
        self.source = source
        self.read = source.open(spec)  # the producer's checks, as for any remote reader

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.read_layer(self.read.spec, layer, self.read)


class InProcessTransport(KVTransport):
    def serve(self, source: KVSource) -> Any:
        key = (self.config.engine_id, self.rank)
        with _LOCK:
            _SOURCES[key] = source
        return {"engine_id": key[0], "rank": key[1]}

    @staticmethod
    def _source(address: Any) -> KVSource:
        with _LOCK:
            source = _SOURCES.get((address["engine_id"], address["rank"]))
        if source is None:
            raise ConnectionError(f"no producer engine {address['engine_id']} rank {address['rank']} in this process")
        return source

    def read(self, address: Any, spec: ReadSpec) -> LayerReader:
        return _DirectReader(self._source(address), spec)

    def release(self, address: Any, remote_request_id: str, hold_token: str) -> None:
        try:
            self._source(address).release(remote_request_id, hold_token)
        except ConnectionError:
            pass  # the producer is gone; its blocks went with it

    def close(self) -> None:
        with _LOCK:
            for key in [k for k in _SOURCES if k[0] == self.config.engine_id and k[1] == self.rank]:
                del _SOURCES[key]
