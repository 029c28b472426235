"""The `ray` KV transport: a consumer rank reads a producer rank's KV through Ray calls.

A producer rank lives in a Ray actor that answers `kv_read`: a worker-group rank actor of a TP/PP engine
(read directly), or the engine host itself (a worker in the host's process, read through the engine's
executor). Its address is plain data, because kv_transfer_params travel inside SamplingParams, which are
copied and pickled freely. It names the producer engine one of two ways:

- a Serve replica (the PD Serve app: `serve_app`, `serve_deployment`, `serve_replica` in
  `kv_connector_extra_config`, which the engine host fills in). A Serve replica is no plain actor: the
  consumer calls it through a DeploymentHandle to the producer's deployment, each call naming the
  replica it is for; the deployment's request router (`router.PrefixAffinityRouter`) pins such a call
  to that replica, and when that replica is gone (died, drained) it lands on another, which refuses it
  at once (`EngineHost._check_pinned`), so the consumer falls back to computing the prompt without
  waiting for a timeout. Chosen over serving every read from rank actors (giving TP = 1 engines a rank
  actor of their own) because that would put a Ray hop into every engine step of every PD engine; the
  Serve hop is paid by the reads of TP = 1 producers only (a TP/PP producer's rank actors still answer
  reads directly: the host hands their handles out once, through `kv_rank_endpoints`).
- a named Ray actor (`ray_actor_name`, `ray_namespace`; engine actors started by `pd_pools` for the
  in-process coordinator), resolved with `ray.get_actor`.

A reader asks the producer once for its rank endpoints and caches them per producer incarnation.
`read` fires one call per group of layers at once; `wait_layer` waits for its layer's call only, so the
later layers' reads overlap the consumer's forward pass through the earlier ones. A group is
`ray_layers_per_call` layers where that is set, else as many layers as make `ray_min_call_bytes` of KV
(default 4 MiB): each call costs milliseconds (a Serve call more than an actor call), so a short prompt's
KV goes in one call instead of one per layer (measured on a 6-layer model: the decode leg started ~15 ms
sooner), while a long prompt's layers still arrive one group at a time. Tensors cross as CPU tensors through Ray's object store (a GPU producer copies them to host memory;
the consumer's connector moves them to its device). A read that takes longer than `read_timeout_s`
fails (its call is cancelled), and the consumer computes the prompt itself.

Every `kv_read` call is signed with the deployment's KV secret (`kv_transfer_config.kv_secret`, or
PAGEDSERVE_KV_SECRET[_FILE]; cluster/pd/read_auth.py) and names the hold and its token; the producer
rank verifies the signature before anything else and serves only the hold's own blocks
(kv_transfer/rank_read.py). A release carries the hold's token.
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


# KV bytes one read call carries at least, unless ray_layers_per_call fixes the layers per call.
DEFAULT_MIN_CALL_BYTES = 4 << 20


class _Call:
    """One call in flight to a producer: a Ray ObjectRef or a Serve DeploymentResponse."""

    def __init__(self, pending: Any) -> None:
        self.pending = pending

    def result(self, timeout_s: float) -> Any:
        try:
            if isinstance(self.pending, ray.ObjectRef):
                # A future, not ray.get: this may run on the engine thread of an async actor.
                return self.pending.future().result(timeout=timeout_s)
            return self.pending.result(timeout_s=timeout_s)
        except (GetTimeoutError, TimeoutError):
            self.cancel()
            raise TimeoutError from None

    def cancel(self) -> None:
        try:
            if isinstance(self.pending, ray.ObjectRef):
                ray.cancel(self.pending)
            else:
                self.pending.cancel()
        except Exception:  # noqa: BLE001 - done or gone already
            pass


class _Producer:
    """How a consumer calls one producer engine: a named actor, or one replica of a Serve deployment."""

    def __init__(self, address: dict) -> None:
        self.replica: str | None = address.get("replica")
        if self.replica is not None:
            from ray import serve

            self.handle = serve.get_deployment_handle(address["deployment"], address["app"])
        else:
            try:
                self.handle = ray.get_actor(address["actor"], namespace=address["namespace"])
            except ValueError:
                raise ConnectionError(f"{RayTransport.describe(address)}: no such actor (it is gone)") from None

    def call(self, method: str, *args: Any) -> _Call:
        if self.replica is None:
            return _Call(getattr(self.handle, method).remote(*args))
        return _Call(self.handle.options(method_name=method).remote(*args, replica=self.replica))


def _producer_key(address: dict) -> tuple:
    if address.get("replica") is not None:
        return ("serve", address["app"], address["deployment"], address["replica"])
    return ("actor", address["namespace"], address["actor"])


class _RayLayerReader(LayerReader):
    def __init__(self, transport: RayTransport, address: dict, calls: list[tuple[list[int], _Call]]) -> None:
        self.transport = transport
        self.address = address
        self.deadline = time.monotonic() + transport.read_timeout_s
        self._calls = [call for _, call in calls]
        self._where: dict[int, tuple[_Call, int]] = {}  # layer -> (its call, index in the call's result)
        for layers, call in calls:
            for i, layer in enumerate(layers):
                self._where[layer] = (call, i)
        self._results: dict[int, list] = {}
        self._done: set[int] = set()  # calls whose result arrived

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        call, index = self._where[layer]
        result = self._results.get(id(call))
        if result is None:
            try:
                result = call.result(max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"KV read from {self.transport.describe(self.address)} took longer than "
                                   f"read_timeout_s={self.transport.read_timeout_s:g}") from None
            except (RayActorError, ConnectionError):
                self.transport.forget(self.address)
                raise
            self._results = {id(call): result}  # earlier calls' layers are done with (layers come in order)
            self._done.add(id(call))
        return result[index]

    def close(self) -> None:
        for call in self._calls:  # a read given up on (a fallback) stops its calls still in flight
            if id(call) not in self._done:
                call.cancel()
        self._calls.clear()
        self._where.clear()
        self._results.clear()
        self._done.clear()


class RayTransport(KVTransport):
    def __init__(self, config, layout, rank, device) -> None:
        super().__init__(config, layout, rank, device)
        extra = config.extra
        self.read_timeout_s = float(extra["read_timeout_s"])
        per_call = extra.get("ray_layers_per_call")
        self.layers_per_call: int | None = None if per_call is None else max(1, int(per_call))
        self.min_call_bytes = max(1, int(extra.get("ray_min_call_bytes", DEFAULT_MIN_CALL_BYTES)))
        self.actor_name: str | None = extra.get("ray_actor_name")
        self.namespace: str | None = extra.get("ray_namespace")
        # In a Serve replica (the engine host sets them): where consumers reach this producer.
        self.serve_address = {key: extra[f"serve_{key}"] for key in ("app", "deployment", "replica")
                              if extra.get(f"serve_{key}") is not None}
        self.token: str | None = None
        # The deployment secret: signs this rank's reads (consumer), verifies readers (producer: `verifier`).
        self.secret = config.secret()
        self.verifier: ReadVerifier | None = None
        self._lock = threading.Lock()
        # (producer key, token) -> per rank: a rank actor handle, or None for a rank in the engine host.
        self._ranks: dict[tuple, list] = {}
        self._producers: dict[tuple, _Producer] = {}

    # ------------------------------------------------------------------ producer

    def serve(self, source: KVSource) -> Any:
        if not ray.is_initialized():
            raise RuntimeError("kv_connector 'ray': the producer rank is not running under Ray")
        self.token = uuid.uuid4().hex
        self.verifier = ReadVerifier(self.secret, self.rank)
        if len(self.serve_address) == 3:
            return {**self.serve_address, "rank": self.rank, "token": self.token}
        context = ray.get_runtime_context()
        name = self.actor_name or _current_actor_name(context)
        if not name:
            raise ValueError("kv_connector 'ray': a producer must run in an engine Serve replica or a named Ray "
                             "engine actor; set kv_transfer_config.kv_connector_extra_config.ray_actor_name")
        return {"actor": name, "namespace": self.namespace or context.namespace, "rank": self.rank,
                "token": self.token}

    # ------------------------------------------------------------------ consumer

    @staticmethod
    def describe(address: dict) -> str:
        who = address.get("replica") or address.get("actor")
        return f"producer {who!r} rank {address.get('rank')}"

    def _producer(self, address: dict) -> _Producer:
        key = _producer_key(address)
        with self._lock:
            producer = self._producers.get(key)
        if producer is None:
            producer = _Producer(address)
            with self._lock:
                self._producers[key] = producer
        return producer

    def _rank_endpoint(self, address: dict) -> tuple[_Producer, Any]:
        """(the producer, the rank actor serving the address's rank or None: the producer's host serves it)."""
        producer = self._producer(address)
        key = (*_producer_key(address), address["token"])
        with self._lock:
            ranks = self._ranks.get(key)
        if ranks is None:
            try:
                ranks = producer.call("kv_rank_endpoints").result(self.read_timeout_s)
            except TimeoutError:
                raise TimeoutError(f"{self.describe(address)} did not answer within "
                                   f"read_timeout_s={self.read_timeout_s:g}") from None
            except (RayActorError, ConnectionError):
                self.forget(address)
                raise
            with self._lock:
                self._ranks[key] = ranks
        return producer, ranks[address["rank"]]

    def forget(self, address: dict) -> None:
        """Drop cached handles of a producer that failed (a restarted one is resolved afresh)."""
        key = _producer_key(address)
        with self._lock:
            self._producers.pop(key, None)
            for cached in [k for k in self._ranks if k[:len(key)] == key]:
                del self._ranks[cached]

    def group_size(self, spec: ReadSpec) -> int:
        """Layers per call for `spec`: `ray_layers_per_call`, else enough for `ray_min_call_bytes` of KV."""
        if self.layers_per_call is not None:
            return self.layers_per_call
        itemsize = torch.empty((), dtype=getattr(torch, self.layout.dtype)).element_size()
        layer_bytes = 2 * spec.num_tokens * (spec.head_end - spec.head_start) * self.layout.head_size * itemsize
        return max(1, min(len(spec.layers), -(-self.min_call_bytes // max(1, layer_bytes))))

    def read(self, address: Any, spec: ReadSpec) -> LayerReader:
        producer, rank_actor = self._rank_endpoint(address)
        layers = list(spec.layers)
        calls = []
        per_call = self.group_size(spec)
        for start in range(0, len(layers), per_call):
            group = layers[start:start + per_call]
            auth = sign_read(self.secret, address["token"], address["rank"], spec, group)
            if rank_actor is None:
                call = producer.call("kv_read", address["rank"], address["token"], spec, group, auth)
            else:
                call = _Call(rank_actor.kv_read.remote(address["token"], spec, group, auth))
            calls.append((group, call))
        return _RayLayerReader(self, address, calls)

    def release(self, address: Any, remote_request_id: str, hold_token: str) -> None:
        # Every rank's address names the same producer engine, which frees the hold's blocks: tell it once.
        if address.get("rank") != 0:
            return
        try:
            self._producer(address).call("kv_release", remote_request_id, hold_token)
        except ConnectionError:
            pass  # the producer is gone; its blocks went with it

    def close(self) -> None:
        with self._lock:
            self._producers.clear()
            self._ranks.clear()


def _current_actor_name(context: Any) -> str | None:
    try:
        return context.get_actor_name() or None
    except Exception:  # noqa: BLE001 - not in an actor
        return None
