"""The engine host: one `AsyncLLM`, stepping continuously with many requests in flight, behind the methods
every engine shape calls. It is the body of every engine Serve deployment (`<app>-engine`,
`<app>-prefill`, `<app>-decode`: one replica = one engine) and, wrapped by `ray.remote`, of the plain
engine actors the in-process `DPCoordinator` drives (`engine_actor.start_engine_actors`: offline and
benchmark use, and the PD pools without Serve in `pd_pools`).

Requests: `generate(request_id, prompt, sampling_params, priority, final_only, cache_salt)` streams the
engine's DELTA `RequestOutput`s (with `final_only`, CHECKPOINT deltas: one per checkpoint interval and
the finish, the text decoded once at the end). The prompt is token ids (what
the Serve request routers read as the call's second argument) or an engine prompt dict. The prompt goes
once, in a stream's first output (`stream_transport`); a stream pauses while its reader is behind
(gRPC's flow control, or `STREAM_BACKPRESSURE_OBJECTS` unread outputs of a Ray streaming call). A
streamed request sends at most one delta per `stream_interval` generated tokens
(`engine.delta_coalescer`: its first tokens and its finish at once). `abort_requests` ends the named streams with one final "abort" output (the engine itself emits
nothing for an aborted request: `AsyncLLM.end_streams` ends the stream after the outputs already on
their way, so an output costs no race against an abort signal); cancelling a Serve stream aborts its
request too.

Serve's lifecycle: `check_health` is the health check (the engine loop died, or it stalls with work
waiting); a replica being removed (scale-down, rolling update) stops getting requests and finishes what
it holds within the deployment's graceful-shutdown window before `__del__` stops the engine. With TP/PP
> 1 the replica's placement group (bundle 0 for the replica, one per rank) holds the rank actors
(`cluster/executor/ray_executor.py`), so Serve places, checks and replaces the whole group together.
If the engine loop dies, a watchdog thread exits the process so that Ray (or Serve) replaces it.

Threads (`ray_utils.engine_threads`): `cpu_threads`, else the CPUs reserved by choice, else (a default
1-CPU reservation) the node's CPUs shared by the app's engines (`engines_per_node`).

Stats: `get_stats` (a typed `cluster.engine_stats.EngineStats`: the engine's figures, its incarnation -
new on every (re)start -, health, stream outputs, KV transfer, speculative decoding, LoRA),
`record_routing_stats` (the same record as a dict, what the request routers and /metrics read, with the
prompt prefixes this engine served, its resident LoRA adapters and its KV events: `kv_feed`) and
`record_autoscaling_stats` (the per-role autoscaling signals, `pd_autoscaling`).

PD (cluster/pd/): in a Serve replica whose engine has a kv_transfer_config, the host names the engine
after the replica (`engine_id`) and tells the Ray KV transport its own address (app, deployment,
replica), so that a consumer reaches this producer through a handle to the deployment, pinned to this
replica (`router.PrefixAffinityRouter`): `kv_rank_endpoints`, `kv_read` and `kv_release` take the replica
they were meant for and refuse a call that reached another one. A rank in this process is read through
the engine (`AsyncLLM.kv_read`: executor -> worker), never by reaching into it.

The offload tier across nodes (cluster/serve/tier_peer.py, kv_transfer/offload/remote.py): `kv_tier_read`
serves blocks of this node's tier to a peer's signed read (pinned to this replica like the PD reads); a
`generate` call whose router named a peer (`kv_tier_peer`) fetches the prompt's blocks this node's tier
lacks from that peer first (`kv_tier_fetch`, bounded), then the engine loads them from its own tier. The
reads are signed with the KV secret (kv_transfer/auth.py), in a data-parallel app the one it hands every
replica (`kv_secret`: generated per app build unless the operator set PAGEDSERVE_KV_SECRET or _FILE).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from pydantic import SecretStr, ValidationError

from pagedserve.cluster.executor.placement import restrict_to_assigned_gpus, with_engine_kv_share
from pagedserve.cluster.executor.ray_utils import assigned_cpus, use_engine_threads
from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.serve.kv_feed import KVEventFeed
from pagedserve.cluster.serve.routing_policy import prefix_hashes, short_hash
from pagedserve.cluster.serve.stream_transport import STREAM_BACKPRESSURE_OBJECTS, PromptElider, abort_output
from pagedserve.cluster.serve.tier_peer import TierFetcher, TierPeer, fetch_failures, tier_secret
from pagedserve.engine.async_llm import AsyncLLM, StreamEndedError
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.lora.request import pop_lora_request
from pagedserve.engine.output_processor import CHECKPOINT_INTERVAL_S, OutputKind
from pagedserve.engine.outputs import EmbeddingRequestOutput, RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kv_transfer.offload.remote import TierReadVerifier, block_file_limit, read_tier_blocks

logger = logging.getLogger(__name__)

# Prefix lengths (in blocks) a replica reports hashes for: the router may use any affinity_blocks up to it.
REPORTED_PREFIX_BLOCKS = 8
# Most prefix hashes a replica remembers and reports (newest first out of the LRU, oldest dropped).
MAX_REPORTED_PREFIXES = 4096

# Where a Serve engine replica tells the Ray KV transport its own address (cluster/pd/ray_transport.py).
SERVE_ADDRESS_KEYS = ("serve_app", "serve_deployment", "serve_replica")


def _plain_value_error(exc: ValueError) -> ValueError:
    """pydantic's ValidationError does not survive Ray's pickling/re-wrapping well: send a plain ValueError."""
    if isinstance(exc, ValidationError) or type(exc) is not ValueError:
        return ValueError(str(exc))
    return exc


def _node_id() -> str | None:
    """The Ray node this engine runs on (None outside Ray)."""
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


def _serve_replica() -> tuple[str, str, str] | None:
    """(app, deployment, replica id) when this runs in a Serve replica, else None."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not in a Serve replica (a plain actor, a unit test)
        return None
    replica_id = context.replica_id
    return replica_id.deployment_id.app_name, replica_id.deployment_id.name, replica_id.unique_id


def in_replica_engine_kwargs(engine_kwargs: dict, where: tuple[str, str, str]) -> dict:
    """A PD engine's kwargs inside a Serve replica: its engine_id is the replica's id and its Ray KV
    transport serves at (app, deployment, replica). Engines without a KV role are unchanged."""
    kv = engine_kwargs.get("kv_transfer_config")
    if not kv:
        return engine_kwargs
    kv = dict(kv)
    kv["engine_id"] = where[2]
    kv["kv_connector_extra_config"] = {**(kv.get("kv_connector_extra_config") or {}),
                                       **dict(zip(SERVE_ADDRESS_KEYS, where))}
    return {**engine_kwargs, "kv_transfer_config": kv}


def _prompt_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), (list, tuple)):
        return list(prompt["prompt_token_ids"])
    return None


class EngineHost:
    """Hosts one engine: a Serve deployment's body, or a plain actor class under `ray.remote`."""

    def __init__(
        self,
        engine_kwargs: dict,
        engine_index: int = 0,
        max_pending_requests: int = 1024,
        stall_timeout_s: float = 120.0,
        kv_secret: SecretStr | None = None,
        engines_per_node: int | None = None,
        stream_interval: int | str = 1,
    ) -> None:
        restrict_to_assigned_gpus()  # before anything initialises CUDA in this process
        where = _serve_replica()
        self.replica = where[2] if where is not None else "local"
        self.node_id = _node_id()
        if where is not None:  # a Serve replica takes its CPU share of the node's KV budget, its PD address
            engine_kwargs = in_replica_engine_kwargs(with_engine_kv_share(engine_kwargs, assigned_cpus()), where)
        use_engine_threads(engine_kwargs.get("cpu_threads"), engines_per_node)
        self.engine_index = engine_index
        # Identifies this incarnation: a restarted engine's counters start again from zero.
        self.incarnation = uuid.uuid4().hex
        self.engine = AsyncLLM(EngineConfig(**engine_kwargs), max_pending_requests=max_pending_requests,
                               stall_timeout_s=stall_timeout_s, stream_interval=stream_interval)
        self.block_size = self.engine.config.block_size
        # The request ids of the generate() streams open here (one engine request each).
        self._live: set[str] = set()
        self._num_stream_outputs = 0
        self._prefixes: OrderedDict[str, None] = OrderedDict()
        self._in_flight_prompt_tokens = 0  # prompt tokens of the requests in generate(): prefill's queue
        # The engine's KV events, riding on the routing stats to every router's index (kv_feed.py).
        self.kv_feed = KVEventFeed(self.engine, self.incarnation)
        # The offload tier across nodes (made on first use): peers' signed reads, this engine's fetches.
        # The app's KV secret (`app.build_app`: one per app unless the operator set PAGEDSERVE_KV_SECRET[_FILE]),
        # which signs the tier reads between its replicas; a kv_transfer_config's own kv_secret comes first.
        self._app_kv_secret = kv_secret
        self._tier_verifier: TierReadVerifier | None = None
        self._tier_fetcher: TierFetcher | None = None
        # final_only requests: one output per this many seconds (the most generation a migration redoes).
        self.final_only_checkpoint_s = CHECKPOINT_INTERVAL_S
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_engine, name="engine-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("engine %s ready: %d KV blocks", self.replica, self.engine.num_kv_blocks)

    # ------------------------------------------------------------------ requests

    async def ready(self) -> dict:
        """The engine's settings, this replica, and the Ray nodes it and its TP/PP ranks run on."""
        config = self.engine.config
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                restarted = ray.get_runtime_context().was_current_actor_reconstructed
        except Exception:  # noqa: BLE001 - not running inside a Ray actor
            restarted = False
        return {
            "engine_index": self.engine_index,
            "num_kv_blocks": self.engine.num_kv_blocks,
            "block_size": config.block_size,
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "model": config.model,
            "served_model_name": config.served_model_name,
            "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size,
            "device": config.device,
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "node_id": self.node_id,
            "rank_node_ids": [node or self.node_id for node in self.engine.rank_node_ids()],
            "replica": self.replica,
            "restarted": bool(restarted),
        }

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS)
    async def generate(
        self, request_id: str, prompt: list[int] | str | dict, sampling_params: dict, priority: int = 0,
        final_only: bool = False, cache_salt: str | None = None, pooling_params: dict | None = None,
        kv_tier_peer: dict | None = None,
    ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Stream DELTA outputs, the prompt only in the first (see `stream_transport`). With `final_only`
        (the caller reads nothing before the end: a non-streaming HTTP request) the engine runs it
        `OutputKind.CHECKPOINT`: deltas, one per `final_only_checkpoint_s` and the finished one, each
        completion's text whole in its finishing delta (decoded once, not per step): what a migration
        continues from, at about the cost of one finished output. `cache_salt` goes into
        the engine prompt (its prefix-cache hashes). Closing or cancelling the stream aborts the request.
        ValueError (bad input), EngineOverloadedError and EngineDeadError propagate. With `pooling_params`
        (PoolingParams fields) it is an embedding request (`AsyncLLM.encode`): one finished
        EmbeddingRequestOutput; `sampling_params` is ignored. A LoRA adapter rides in the sampling params
        (`engine.lora.request.SAMPLING_KEY`). `kv_tier_peer` (set by the request router): a replica on another
        node whose offload tier holds the prompt's prefix; it is fetched first (`kv_tier_fetch`)."""
        try:
            sampling_params, lora_request = pop_lora_request(sampling_params)
            if pooling_params is not None:
                params: SamplingParams | PoolingParams = PoolingParams(**pooling_params)
            else:
                params = SamplingParams(**sampling_params)
        except ValueError as exc:
            raise _plain_value_error(exc) from None
        if request_id in self._live:
            raise ValueError(f"request_id: {request_id!r} is already running on engine {self.replica}")
        ids = _prompt_ids(prompt)
        if isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        if cache_salt is not None and isinstance(prompt, dict):
            prompt = {**prompt, "cache_salt": cache_salt}
        if ids is not None:
            self._remember(ids, cache_salt, lora_request.cache_key if lora_request is not None else ())
            if kv_tier_peer is not None:
                await self.kv_tier_fetch(kv_tier_peer, ids, cache_salt,
                                         lora_request.cache_key if lora_request is not None else ())
        prompt_tokens = len(ids) if ids is not None else 0
        self._in_flight_prompt_tokens += prompt_tokens
        self._live.add(request_id)
        if isinstance(params, PoolingParams):
            stream = self.engine.encode(prompt, params, request_id=request_id, priority=priority)
        else:
            kind = OutputKind.DELTA
            if final_only:  # (a prompt of text: one finished output, nothing a migration could continue)
                kind = OutputKind.CHECKPOINT if ids is not None else OutputKind.FINAL_ONLY
            stream = self.engine.generate(prompt, params, request_id=request_id, priority=priority,
                                          output_kind=kind, lora_request=lora_request,
                                          checkpoint_interval_s=self.final_only_checkpoint_s)
        elide = PromptElider()
        try:
            try:
                # abort_requests() ends the stream itself (`AsyncLLM.end_streams`): no per-output race
                # against an abort signal (a task and a wait per output, on the engine's own cores).
                async for output in stream:
                    # Counted before the yield: the generator may pause there (backpressure).
                    self._num_stream_outputs += 1
                    yield elide(output)
            except StreamEndedError:  # the engine emits nothing for an aborted request: end it here
                self._num_stream_outputs += 1
                yield elide(abort_output(request_id, prompt, params))
            except ValueError as exc:
                raise _plain_value_error(exc) from None
        finally:
            self._in_flight_prompt_tokens -= prompt_tokens
            self._live.discard(request_id)
            await stream.aclose()  # aborts the engine request if it did not finish

    async def abort(self, request_id: str) -> None:
        await self.abort_requests([request_id])

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort many requests in one call (one engine command): a mass disconnect costs one RPC."""
        self.engine.end_streams(list(request_ids))

    # ------------------------------------------------------------------ stats and health

    async def get_stats(self) -> EngineStats:
        """This engine's figures and extras (`EngineStats.from_scheduler`), with who reports them."""
        stats = self.engine.get_stats()
        now = time.monotonic()
        # stats_time orders the answers of one incarnation (concurrent polls may arrive out of order).
        return EngineStats.from_scheduler(
            stats.scheduler, engine_index=self.engine_index, replica=self.replica, incarnation=self.incarnation,
            stats_time=now, healthy=stats.healthy, num_unfinished=stats.num_unfinished,
            last_step_age_s=max(0.0, now - stats.last_step_time), num_stream_outputs=self._num_stream_outputs,
            kv_tier_fetch_failures=fetch_failures(self._tier_fetcher, self.engine.config.kv_offload_size is not None))

    async def check_health(self) -> None:
        """Serve's health check: raises when the engine loop died or stalls with work waiting."""
        await self.engine.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request router and the ingress's /metrics see of this replica: its `EngineStats` as a dict
        (Serve's routing stats must be one; the engine client reads it back with `EngineStats.from_dict`),
        with the prompt prefixes this engine served, its resident LoRA adapters and its KV events."""
        stats = await self.get_stats()
        out = stats.to_dict()
        out.update(block_size=self.block_size, prefix_hashes=list(self._prefixes),
                   lora_adapters=list(stats.lora.get("resident", ())), kv_events=await self.kv_feed.report())
        return out

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (`pd_autoscaling.RoleAutoscalingPolicy` reads them)."""
        scheduler = self.engine.get_stats().scheduler
        return {"queued_prompt_tokens": float(self._in_flight_prompt_tokens),
                "num_seqs": float(scheduler.num_running + scheduler.num_waiting),
                "kv_cache_usage": float(scheduler.kv_cache_usage)}

    def _remember(self, prompt_token_ids: list[int], cache_salt: str | None, lora_key: tuple = ()) -> None:
        for block_hash in prefix_hashes(prompt_token_ids, self.block_size, REPORTED_PREFIX_BLOCKS, cache_salt,
                                        lora_key):
            key = short_hash(block_hash)
            self._prefixes[key] = None
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_REPORTED_PREFIXES:
            self._prefixes.popitem(last=False)

    # ------------------------------------------------------------------ KV transfer (cluster/pd)

    def _check_pinned(self, replica: str | None) -> None:
        """A call meant for one replica (the Ray transport pins it) that reached another: that one is gone."""
        if replica is not None and replica != self.replica:
            raise ConnectionError(f"producer replica {replica!r} is gone (this is {self.replica!r})")

    async def kv_rank_endpoints(self, replica: str | None = None) -> list:
        """Per rank, the Ray actor a PD consumer reads that rank's KV from directly, or None for a rank in
        this process (read with `kv_read` here)."""
        self._check_pinned(replica)
        return self.engine.kv_rank_endpoints()

    async def kv_read(self, rank: int, token: str, spec: Any, layers: list[int], auth: Any,
                      replica: str | None = None) -> list:
        """A PD consumer reads the KV of a rank in this process (signed: cluster/pd/read_auth.py; through
        the executor, off the event loop)."""
        self._check_pinned(replica)
        return await asyncio.to_thread(self.engine.kv_read, rank, token, spec, layers, auth)

    async def kv_release(self, request_id: str, hold_token: str, replica: str | None = None) -> None:
        """A PD consumer is done with a finished prefill's KV: free its blocks (only with the hold's token)."""
        self._check_pinned(replica)
        self.engine.release_kv([(request_id, hold_token)])

    # ------------------------------------------------------------------ the offload tier across nodes

    def _kv_secret(self) -> bytes:
        return tier_secret(self.engine.config.kv_transfer_config, self._app_kv_secret)

    async def kv_tier_read(self, namespace: str, hashes: list[bytes], auth: Any,
                           replica: str | None = None) -> dict[bytes, list[bytes]]:
        """A peer on another node reads blocks of this node's offload tier by their prefix-cache hashes
        (kv_transfer/offload/remote.py): signed with the deployment's KV secret (else refused), for this
        tier's namespace (else nothing); a hash the tier does not hold whole is left out."""
        self._check_pinned(replica)
        tier = self.engine.kv_offload_tier()
        if tier is None:
            return {}
        if self._tier_verifier is None:
            self._tier_verifier = TierReadVerifier(self._kv_secret(), self.replica)
        self._tier_verifier.verify(auth, namespace, hashes)
        if namespace != tier.location.namespace.name:
            return {}
        return await asyncio.to_thread(read_tier_blocks, tier.location, hashes, block_file_limit(tier.block_bytes))

    async def kv_tier_fetch(self, peer: dict, prompt_token_ids: list[int], cache_salt: str | None = None,
                            lora_key: tuple = ()) -> int:
        """Fetch the prompt's blocks this node's tier lacks from `peer`'s (cluster/serve/tier_peer.py); returns
        how many arrived. 0 without a tier, for a malformed hint, or when the fetch failed (bounded)."""
        where, tier = TierPeer.from_hint(peer), self.engine.kv_offload_tier()
        if where is None or tier is None or where.replica == self.replica:
            return 0
        if self._tier_fetcher is None:
            self._tier_fetcher = TierFetcher(tier, self._kv_secret())
        hashes = prefix_hashes(prompt_token_ids, self.block_size, max(0, len(prompt_token_ids) - 1) // self.block_size,
                               cache_salt, lora_key)
        return await self._tier_fetcher.fetch(where, hashes)

    # ------------------------------------------------------------------ shutdown and the watchdog

    def shutdown(self) -> None:
        self._stopped.set()
        self.engine.shutdown()

    def _watch_engine(self) -> None:
        """If the engine loop dies (not merely stalls), exit so that Ray (or Serve) replaces this process."""
        while not self._stopped.wait(1.0):
            if not self.engine.get_stats().engine_alive:
                logger.error("engine %s: the engine loop died; exiting so that it is replaced", self.replica)
                time.sleep(1.0)  # let the in-flight requests receive their EngineDeadError
                if not self._stopped.is_set():
                    self._on_engine_death()
                return

    def _on_engine_death(self) -> None:
        os._exit(1)  # a crash (not a clean exit_actor) so that Ray restarts the actor

    def __del__(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.shutdown()
