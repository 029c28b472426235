"""The `ray` KV transport: a consumer rank reads a producer rank's KV through Ray actor calls.

A producer rank lives in a Ray actor that answers `kv_read` (an engine actor whose worker runs in its
own process, or a worker-group rank actor of a TP/PP engine). Its address is plain data - the engine
actor's name and namespace, the rank, and the serving token - because kv_transfer_params travel
inside SamplingParams, which are copied and pickled freely. A reader resolves the engine actor by
name (`ray.get_actor`), asks it once for its rank actors, and caches them per producer incarnation.

`read` fires one actor call per group of `ray_layers_per_call` layers at once; `wait_layer` waits for
its layer's call only, so the later layers' reads overlap the consumer's forward pass through the
earlier ones. Tensors cross as CPU tensors through Ray's object store (a GPU producer copies them to
host memory; the consumer's connector moves them to its device). A read that takes longer than
`read_timeout_s` fails, and the consumer computes the prompt itself.

Every `kv_read` call is signed with the deployment's KV secret (`kv_transfer_config.kv_secret`, or
PAGEDSERVE_KV_SECRET[_FILE]; cluster/pd/read_auth.py) and names the hold and its token; the producer
rank verifies the signature before anything else and serves only the hold's own blocks
(cluster/pd/rank_server.py). A release carries the hold's token.

The producer's engine actor name comes from `kv_connector_extra_config` (`ray_actor_name`,
`ray_namespace`; the PD pools set them), else from the current actor when it is a named one.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from pagedserve.cluster.pd.read_auth import ReadVerifier, sign_read
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.transport import KVTransport, LayerReader


class _RayLayerReader(LayerReader):
    def __init__(self, transport: RayTransport, address: dict, calls: list[tuple[list[int], Any]]) -> None:
        self.transport = transport
        self.address = address
        self.deadline = time.monotonic() + transport.read_timeout_s
        self._where: dict[int, tuple[Any, int]] = {}  # layer -> (its call's ref, index in the call's result)
        for layers, ref in calls:
            for i, layer in enumerate(layers):
                self._where[layer] = (ref, i)
        self._results: dict[Any, list] = {}

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ref, index = self._where[layer]
        result = self._results.get(ref)
        if result is None:
            try:
                # A future, not ray.get: this runs on the engine thread of an async actor, not its event loop.
                result = ref.future().result(timeout=max(0.0, self.deadline - time.monotonic()))
            except (GetTimeoutError, TimeoutError):
                raise TimeoutError(f"KV read from {self.transport.describe(self.address)} took longer than "
                                   f"read_timeout_s={self.transport.read_timeout_s:g}") from None
            except RayActorError:
                self.transport.forget(self.address)
                raise
            self._results = {ref: result}  # earlier calls' layers are done with (layers come in order)
        return result[index]

    def close(self) -> None:
        self._where.clear()
        self._results.clear()


class RayTransport(KVTransport):
    def __init__(self, config, layout, rank, device) -> None:
        super().__init__(config, layout, rank, device)
        extra = config.extra
        self.read_timeout_s = float(extra["read_timeout_s"])
        self.layers_per_call = max(1, int(extra.get("ray_layers_per_call", 1)))
        self.actor_name: str | None = extra.get("ray_actor_name")
        self.namespace: str | None = extra.get("ray_namespace")
        self.token: str | None = None
        # The deployment secret: signs this rank's reads (consumer), verifies readers (producer: `verifier`).
        self.secret = config.secret()
        self.verifier: ReadVerifier | None = None
        self._lock = threading.Lock()
        # (namespace, engine actor name, token) -> per rank: a rank actor handle, or None for the engine actor.
        self._ranks: dict[tuple, list] = {}
        self._engines: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ producer

    def serve(self, source: KVSource) -> Any:
        if not ray.is_initialized():
            raise RuntimeError("kv_connector 'ray': the producer rank is not running under Ray")
        context = ray.get_runtime_context()
        name = self.actor_name or _current_actor_name(context)
        if not name:
            raise ValueError("kv_connector 'ray': a producer must run in a named Ray engine actor; set "
                             "kv_transfer_config.kv_connector_extra_config.ray_actor_name (the PD pools do)")
        self.token = uuid.uuid4().hex
        self.verifier = ReadVerifier(self.secret, self.rank)
        return {"actor": name, "namespace": self.namespace or context.namespace, "rank": self.rank,
                "token": self.token}

    # ------------------------------------------------------------------ consumer

    @staticmethod
    def describe(address: dict) -> str:
        return f"producer {address.get('actor')!r} rank {address.get('rank')}"

    def _engine(self, address: dict) -> Any:
        key = (address["namespace"], address["actor"])
        with self._lock:
            handle = self._engines.get(key)
        if handle is None:
            try:
                handle = ray.get_actor(address["actor"], namespace=address["namespace"])
            except ValueError:
                raise ConnectionError(f"{self.describe(address)}: no such actor (it is gone)") from None
            with self._lock:
                self._engines[key] = handle
        return handle

    def _rank_actor(self, address: dict) -> tuple[Any, bool]:
        """(the actor serving the address's rank, whether it is the engine actor itself)."""
        engine = self._engine(address)
        key = (address["namespace"], address["actor"], address["token"])
        with self._lock:
            ranks = self._ranks.get(key)
        if ranks is None:
            try:
                ranks = engine.kv_rank_actors.remote().future().result(timeout=self.read_timeout_s)
            except TimeoutError:
                raise TimeoutError(f"{self.describe(address)} did not answer within "
                                   f"read_timeout_s={self.read_timeout_s:g}") from None
            except RayActorError:
                self.forget(address)
                raise
            with self._lock:
                self._ranks[key] = ranks
        actor = ranks[address["rank"]]
        return (engine, True) if actor is None else (actor, False)

    def forget(self, address: dict) -> None:
        """Drop cached handles of a producer that failed (a restarted one is resolved afresh)."""
        with self._lock:
            self._engines.pop((address["namespace"], address["actor"]), None)
            for key in [k for k in self._ranks if k[:2] == (address["namespace"], address["actor"])]:
                del self._ranks[key]

    def read(self, address: Any, spec: ReadSpec) -> LayerReader:
        actor, is_engine = self._rank_actor(address)
        layers = list(spec.layers)
        calls = []
        for start in range(0, len(layers), self.layers_per_call):
            group = layers[start:start + self.layers_per_call]
            auth = sign_read(self.secret, address["token"], address["rank"], spec, group)
            if is_engine:
                ref = actor.kv_read.remote(address["rank"], address["token"], spec, group, auth)
            else:
                ref = actor.kv_read.remote(address["token"], spec, group, auth)
            calls.append((group, ref))
        return _RayLayerReader(self, address, calls)

    def release(self, address: Any, remote_request_id: str, hold_token: str) -> None:
        # Every rank's address names the same engine actor, which frees the hold's blocks: tell it once.
        if address.get("rank") != 0:
            return
        try:
            self._engine(address).kv_release.remote(remote_request_id, hold_token)
        except ConnectionError:
            pass  # the producer is gone; its blocks went with it

    def close(self) -> None:
        with self._lock:
            self._engines.clear()
            self._ranks.clear()


def _current_actor_name(context: Any) -> str | None:
    try:
        return context.get_actor_name() or None
    except Exception:  # noqa: BLE001 - not in an actor
        return None
