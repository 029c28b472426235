"""One engine's ranks as Ray actors in one placement group, with a collective RPC over them.

Every rank is a `WorkerActor` pinned to its own bundle (bundle index == rank). Calls to
an actor run one at a time in submission order (Ray's default `max_concurrency=1`), so
every rank sees the same sequence of steps; keep it that way. Any failure of any rank
(an exception, or the actor's process dying) fails the whole group: the other ranks may
be blocked in a collective waiting for the failed one, so the group kills every actor,
removes its placement group, and reports the first failure, naming the rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.cluster.executor.placement import (
    check_placeable,
    current_node_cpus,
    kv_share_of_node,
    restrict_to_assigned_gpus,
)
from pagedserve.cluster.executor.ray_utils import free_port, node_ip, tcp_init_method
from pagedserve.engine.config import EngineConfig

logger = logging.getLogger(__name__)

# On a failure, how long to wait for the other ranks of the call to reveal a dead peer (failure path only).
DEAD_PEER_GRACE_S = 3.0
# While a busy cluster has not placed the group yet, say what is pending this often.
WAIT_LOG_PERIOD_S = 30.0

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class WorkerGroupOptions:
    num_cpus_per_worker: float = 1.0
    use_gpu: bool = False
    # PACK by default: ranks share a node where they fit, and the group may still span nodes.
    strategy: str = "PACK"
    # How long to wait for the cluster to offer every bundle before giving up.
    placement_timeout_s: float = 300.0
    # A placement group someone else owns (a Serve replica's): rank r goes to bundle first_bundle + r,
    # and the group neither creates nor removes a placement group of its own.
    placement_group: PlacementGroup | None = None
    first_bundle: int = 0

    def __post_init__(self) -> None:
        if self.num_cpus_per_worker <= 0:
            raise ValueError(f"num_cpus_per_worker: must be positive, got {self.num_cpus_per_worker}")
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_group_strategy: {self.strategy!r} is not one of {PLACEMENT_STRATEGIES}")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s: must be positive, got {self.placement_timeout_s}")

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle: its CPUs, and its GPU when the engine runs on CUDA."""
        bundle: dict[str, float] = {"CPU": self.num_cpus_per_worker}
        if self.use_gpu:
            bundle["GPU"] = 1
        return bundle


@dataclass
class RankInfo:
    rank: int
    node_ip: str = "?"
    pid: int = -1
    actor_id: str = "?"
    node_id: str = "?"

    def describe(self) -> str:
        return f"rank {self.rank} (Ray actor {self.actor_id}, node {self.node_ip}, pid {self.pid})"


class WorkerGroupError(RuntimeError):
    """A rank of the group failed; the group has been shut down."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerActor:
    """A thin actor around `engine.worker.Worker`: one rank of one engine."""

    def __init__(self, config: EngineConfig, rank: int, num_threads: int) -> None:
        restrict_to_assigned_gpus()  # before torch can initialise CUDA: cuda:0 is this rank's own GPU
        import torch

        torch.set_num_threads(max(1, num_threads))
        self.config = _with_node_kv_share(config, rank)
        self.rank = rank
        self.worker = None

    def node_info(self) -> tuple[str, int, str, str]:
        context = ray.get_runtime_context()
        return node_ip(), os.getpid(), context.get_actor_id(), context.get_node_id()

    def rendezvous_address(self) -> str:
        """A torch.distributed init method on this (the first) node, at a port free here."""
        return tcp_init_method(node_ip(), free_port())

    def init_worker(self, distributed_init_method: str) -> None:
        from pagedserve.engine.worker.worker import Worker

        self.worker = Worker(self.config, rank=self.rank, distributed_init_method=distributed_init_method)
        self.worker.init_device()

    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call `Worker.<method>`; a callable is called as `method(worker, *args, **kwargs)`."""
        if callable(method):
            return method(self.worker, *args, **kwargs)
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_model(self, scheduler_output: Any) -> Any:
        # The hot path: a direct method, no name lookup through execute_method.
        return self.worker.execute_model(scheduler_output)

    def ping(self) -> int:
        return self.rank

    @ray.method(concurrency_group="kv_transfer")
    def kv_read(self, token: str, spec: Any, layers: list[int], auth: Any) -> list:
        """A PD consumer reads this (producer) rank's KV: `Worker.kv_read`. Its own concurrency group, so
        reads never wait behind (or reorder) the steps of the default group."""
        return self.worker.kv_read(token, spec, layers, auth)


RayWorkerActor = ray.remote(concurrency_groups={"kv_transfer": 2})(WorkerActor)


def _with_node_kv_share(config: EngineConfig, rank: int) -> EngineConfig:
    """Without an explicit KV budget, a rank takes its CPU share of its node's default budget: the ranks
    (and engines) placed on one node then never add up to more than one engine's default."""
    if config.kv_cache_memory is not None or config.num_kv_blocks is not None or config.resolved_device != "cpu":
        return config
    node_cpus = current_node_cpus()
    share = min(config.kv_cache_memory_share, kv_share_of_node(config.num_cpus_per_worker, node_cpus))
    logger.info("rank %d: KV budget %.4f of the node's default (%.2f of its %.0f CPUs reserved)", rank, share,
                config.num_cpus_per_worker, node_cpus)
    return config.model_copy(update={"kv_cache_memory_share": share})


@dataclass
class _Resources:
    """What the group must release; held apart from the group so a finalizer can free it."""

    placement_group: PlacementGroup | None = None
    actors: list = field(default_factory=list)


def _release(resources: _Resources) -> None:
    if not ray.is_initialized():
        return
    for actor in resources.actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
    resources.actors = []
    if resources.placement_group is not None:
        try:
            remove_placement_group(resources.placement_group)
        except Exception:
            pass
        resources.placement_group = None


class WorkerGroup:
    """tp * pp worker actors of one engine, in one placement group, joined by torch.distributed."""

    def __init__(self, config: EngineConfig, options: WorkerGroupOptions | None = None) -> None:
        if not ray.is_initialized():
            raise RuntimeError("WorkerGroup: Ray is not initialized; call cluster.executor.ray_utils.ensure_ray() first")
        self.config = config
        self.options = options or WorkerGroupOptions()
        self.world_size = config.world_size
        # The rank that samples and reports results: TP rank 0 of the last pipeline stage.
        self.driver_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.ranks = [RankInfo(rank) for rank in range(self.world_size)]
        self.failure: WorkerGroupError | None = None
        self._lock = threading.Lock()
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, _release, self._resources)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ startup

    def _start(self) -> None:
        opts = self.options
        bundle = opts.bundle()
        if opts.placement_group is not None:
            pg = opts.placement_group
        else:
            bundles = [dict(bundle) for _ in range(self.world_size)]
            check_placeable(bundles, opts.strategy, self._layout(bundle),
                            "lower num_cpus_per_worker, tensor_parallel_size or pipeline_parallel_size, "
                            "choose a placement_group_strategy that may span nodes, or add nodes")
            pg = placement_group(bundles, strategy=opts.strategy)
            self._resources.placement_group = pg
        self._wait_placed(pg, bundle)
        threads = max(1, int(opts.num_cpus_per_worker))
        for rank in range(self.world_size):
            actor = RayWorkerActor.options(
                num_cpus=opts.num_cpus_per_worker,
                num_gpus=1 if opts.use_gpu else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=opts.first_bundle + rank
                ),
            ).remote(self.config, rank, threads)
            self._resources.actors.append(actor)
        for info, answer in zip(self.ranks, self._submit(lambda actor: actor.node_info.remote()).result()):
            info.node_ip, info.pid, info.actor_id, info.node_id = answer
        # Rank 0 sits in bundle 0, on the group's first node: it hosts the rendezvous.
        self.distributed_init_method = self._gather([self.actors[0].rendezvous_address.remote()], [0]).result()[0]
        self._submit(lambda actor: actor.init_worker.remote(self.distributed_init_method)).result()
        self.call_all("load_model")
        logger.info(
            "worker group up: %d ranks (tp=%d, pp=%d) on %s, rendezvous %s",
            self.world_size, self.config.tensor_parallel_size, self.config.pipeline_parallel_size,
            sorted({r.node_ip for r in self.ranks}), self.distributed_init_method,
        )

    def _layout(self, bundle: dict[str, float]) -> str:
        return (f"tp={self.config.tensor_parallel_size} x pp={self.config.pipeline_parallel_size}: "
                f"{self.world_size} ranks of {bundle} each")

    def _wait_placed(self, pg: PlacementGroup, bundle: dict[str, float]) -> None:
        """Wait (at most placement_timeout_s) for a cluster that could hold the group but is busy, saying
        every WAIT_LOG_PERIOD_S what is pending."""
        opts = self.options
        deadline = time.monotonic() + opts.placement_timeout_s
        ready = pg.ready()
        while True:
            left = deadline - time.monotonic()
            try:
                ray.get(ready, timeout=max(0.001, min(WAIT_LOG_PERIOD_S, left)))
                return
            except GetTimeoutError:
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"placement group: the cluster did not offer {self.world_size} bundles of {bundle} "
                    f"(strategy {opts.strategy}) within {opts.placement_timeout_s:.0f}s (placement_timeout_s); "
                    f"available: {ray.available_resources()}"
                ) from None
            logger.warning("waiting for the placement group of %s (strategy %s): %.0fs left; available now: %s",
                           self._layout(bundle), opts.strategy, deadline - time.monotonic(),
                           ray.available_resources())

    @property
    def actors(self) -> list:
        return list(self._resources.actors)

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self._resources.placement_group

    # ------------------------------------------------------------------ calls

    def _submit(self, call: Callable[[Any], Any]) -> "Future[list[Any]]":
        """`call(actor) -> ObjectRef` on every rank, gathered into one Future (results in rank order)."""
        if self.failure is not None:
            raise WorkerGroupError(f"worker group is shut down after an earlier failure: {self.failure}",
                                   self.failure.rank)
        actors = self._resources.actors
        if not actors:
            raise WorkerGroupError("worker group is shut down")
        return self._gather([call(actor) for actor in actors], list(range(len(actors))))

    def call_all_async(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> "Future[list[Any]]":
        """Call `Worker.<method>` (or `method(worker, ...)`) on every rank; a Future of the results in rank
        order. It fails with `WorkerGroupError` as soon as any rank fails, after the group is shut down."""
        kwargs = kwargs or {}
        return self._submit(lambda actor: actor.execute_method.remote(method, *args, **kwargs))

    def execute_model_async(self, scheduler_output: Any) -> Future:
        """One engine step on every rank; a Future of the driver rank's output."""
        # Serialize the step once, not once per rank.
        ref = ray.put(scheduler_output) if self.world_size > 1 else scheduler_output
        return self._driver_result(self._submit(lambda actor: actor.execute_model.remote(ref)))

    def call_all(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.call_all_async(method, args, kwargs).result()

    def collective_rpc_async(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Future:
        """Call `method` on every rank; a Future of the driver rank's result (after all ranks are done)."""
        return self._driver_result(self.call_all_async(method, args, kwargs))

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return self.collective_rpc_async(method, args, kwargs).result()

    def _driver_result(self, gathered: "Future[list[Any]]") -> Future:
        result: Future = Future()

        def pick(done: Future) -> None:
            exc = done.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(done.result()[self.driver_rank])

        gathered.add_done_callback(pick)
        return result

    def _gather(self, refs: list, ranks: list[int]) -> "Future[list[Any]]":
        """A Future over Ray object refs, driven by Ray's completion callbacks (no polling)."""
        out: Future = Future()
        results: list[Any] = [None] * len(refs)
        state = {"remaining": len(refs), "claimed": False}
        lock = threading.Lock()

        def on_done(index: int, done: Future) -> None:
            exc = done.exception()
            with lock:
                if state["claimed"]:
                    return
                if exc is None:
                    results[index] = done.result()
                    state["remaining"] -= 1
                    if state["remaining"]:
                        return
                state["claimed"] = True
            if exc is None:
                out.set_result(results)
                return
            # Ray runs this callback on its own thread, where blocking calls (ray.kill) are unsafe.
            threading.Thread(
                target=self._fail, args=(refs, ranks, index, exc, out), name="worker-group-failure", daemon=True
            ).start()

        for index, ref in enumerate(refs):
            ref.future().add_done_callback(lambda done, index=index: on_done(index, done))
        return out

    def _fail(self, refs: list, ranks: list[int], index: int, exc: BaseException, out: Future) -> None:
        # Under the lock, so that every failed call returns only after the group is down.
        with self._lock:
            if self.failure is None:
                rank, exc = self._root_cause(refs, ranks, index, exc)
                self.failure = self._describe_failure(rank, exc)
                logger.error("%s; shutting the worker group down", self.failure)
                self.shutdown()
                error = self.failure
            else:
                error = WorkerGroupError(f"worker group failed: {self.failure}", self.failure.rank)
        error.__cause__ = exc
        out.set_exception(error)

    @staticmethod
    def _root_cause(refs: list, ranks: list[int], index: int, exc: BaseException) -> tuple[int, BaseException]:
        """A rank whose peer died usually fails too (its collective breaks), and may report first:
        give the other ranks of the call a moment, and blame a dead one if there is one."""
        if isinstance(exc, RayActorError):
            return ranks[index], exc
        others = [i for i in range(len(refs)) if i != index]
        if not others:
            return ranks[index], exc
        ready, _ = ray.wait([refs[i] for i in others], num_returns=len(others), timeout=DEAD_PEER_GRACE_S)
        ready_set = set(ready)
        for i in others:
            if refs[i] in ready_set:
                try:
                    ray.get(refs[i], timeout=0)
                except RayActorError as dead:
                    return ranks[i], dead
                except Exception:
                    pass
        return ranks[index], exc

    def _describe_failure(self, rank: int, exc: BaseException) -> WorkerGroupError:
        who = self.ranks[rank].describe() if 0 <= rank < len(self.ranks) else f"rank {rank}"
        if isinstance(exc, RayActorError):
            return WorkerGroupError(f"pagedserve worker {who} died: {exc.__class__.__name__}", rank)
        if isinstance(exc, RayTaskError):
            cause = exc.cause if exc.cause is not None else exc
            return WorkerGroupError(f"pagedserve worker {who} raised {cause.__class__.__name__}: {cause}", rank)
        return WorkerGroupError(f"pagedserve worker {who} failed: {exc!r}", rank)

    # ------------------------------------------------------------------ health and teardown

    def check_health(self, timeout_s: float = 60.0) -> None:
        """Raise `WorkerGroupError` if the group failed or a rank does not answer within `timeout_s`.

        A ping waits behind calls already queued on each actor."""
        try:
            self._submit(lambda actor: actor.ping.remote()).result(timeout=timeout_s)
        except TimeoutError:
            raise WorkerGroupError(f"worker group: a rank did not answer a ping within {timeout_s:.0f}s") from None

    @property
    def is_alive(self) -> bool:
        return self.failure is None and bool(self._resources.actors)

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group (idempotent; also runs when the group is collected)."""
        self._finalizer()
