"""Tensor/pipeline-parallel engines on Ray worker groups (CPU, gloo, a local 4-CPU Ray).

Greedy outputs of TP=2, PP=2 and TP=2 x PP=2 equal HF's (and so TP=1's) token for token with
chunked prefill and prefix caching; each rank holds only its weight shard; pipeline parallelism
keeps pp batches in flight; a dead or raising worker fails the call with an error naming the
rank, and the group's actors and placement group are gone afterwards.
"""

from __future__ import annotations

import gc
import re
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from pagedserve.cluster.executor.worker_group import WorkerGroupError  # noqa: E402
from pagedserve.engine import LLM  # noqa: E402
from pagedserve.engine.models.loader import load_model  # noqa: E402
from pagedserve.parallel.pipeline import layer_range  # noqa: E402
from pagedserve.parallel.state import ParallelContext  # noqa: E402
from tests.local_ray import fresh_local_ray  # noqa: E402
from tests.test_engine_parity import _hf_model, check_parity, random_prompts  # noqa: E402

LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tensor_parallel_size, pipeline_parallel_size)
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with fresh_local_ray(num_cpus=4):
        yield


def make_llm(path, tp: int, pp: int, **kw) -> LLM:
    kw = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory="16MiB", **kw)
    return LLM(model=str(path), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
               distributed_executor_backend="ray", **kw)


def executor_of(llm: LLM):
    return llm.llm_engine.engine_core.executor


def assert_group_released(pg, actors) -> None:
    # remove_placement_group returns before the GCS records the removal: poll (bounded) for it.
    deadline = time.monotonic() + 30
    while placement_group_table(pg)["state"] != "REMOVED" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert placement_group_table(pg)["state"] == "REMOVED"
    for actor in actors:
        with pytest.raises(RayActorError):
            ray.get(actor.ping.remote(), timeout=60)


# ---- parity, sharding, pipelining -----------------------------------------------------------


def _rank_params(worker) -> dict:
    """Runs inside each actor: where the rank sits and what it holds."""
    model = worker.model_runner.model
    params = {}
    for name, p in model.named_parameters():
        # Bytes of the storage behind the parameter: a view into a full tensor would show here.
        params[name] = (tuple(p.shape), p.numel() * p.element_size(), p.untyped_storage().nbytes())
    ctx = worker.parallel
    return dict(tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, start_layer=model.start_layer, params=params)


def _expected_shard(name: str, full: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if "norm" in name:
        return full  # replicated
    dim = 1 if name.endswith(ROW_PARALLEL) else 0
    shape = list(full)
    assert shape[dim] % tp == 0
    shape[dim] //= tp
    return tuple(shape)


def assert_sharded(llm: LLM, path, tp: int, pp: int) -> None:
    hf_config = llm.llm_engine.config.hf_config
    full = {n: tuple(p.shape) for n, p in
            load_model(str(path), hf_config, torch.float32, ParallelContext.single()).named_parameters()}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    num_layers = hf_config.num_hidden_layers
    ranks = executor_of(llm).collective_rpc(_rank_params)
    assert [(r["pp_rank"], r["tp_rank"]) for r in ranks] == [(p, t) for p in range(pp) for t in range(tp)]
    full_bytes = sum(torch.Size(s).numel() * 4 for s in full.values())
    for r in ranks:
        start, end = layer_range(num_layers, r["pp_rank"], pp)
        assert r["start_layer"] == start
        expected: dict[str, tuple[int, ...]] = {}
        for name, shape in full.items():
            if name.startswith("model.layers."):
                index = int(name.split(".")[2])
                if start <= index < end:
                    local = name.replace(f"model.layers.{index}.", f"model.layers.{index - start}.", 1)
                    expected[local] = _expected_shard(name, shape, tp)
            elif name.startswith("model.embed_tokens.") and r["pp_rank"] == 0:
                expected[name] = _expected_shard(name, shape, tp)
            elif (name.startswith("model.norm.") or name.startswith("lm_head.")) and r["pp_rank"] == pp - 1:
                expected[name] = _expected_shard(name, shape, tp)
        if tied and pp > 1 and r["pp_rank"] == pp - 1:
            # The last stage has no embedding: its LM head holds its own shard of the tied weight.
            expected["lm_head.weight"] = _expected_shard("lm_head.weight", full["model.embed_tokens.weight"], tp)
        got = {name: shape for name, (shape, _, _) in r["params"].items()}
        assert got == expected, f"rank tp={r['tp_rank']} pp={r['pp_rank']}"
        held = sum(nbytes for _, nbytes, _ in r["params"].values())
        assert held == sum(torch.Size(s).numel() * 4 for s in expected.values())
        assert all(storage == nbytes for _, nbytes, storage in r["params"].values()), "a shard is a view"
        assert held < full_bytes


def record_batch_depth(llm: LLM) -> list[int]:
    """Wrap the executor so each submission records how many batches were already in flight."""
    core = llm.llm_engine.engine_core
    executor = core.executor
    depths: list[int] = []
    submit = executor.execute_model_async

    def recording(scheduler_output):
        depths.append(len(core._batch_queue))
        return submit(scheduler_output)

    executor.execute_model_async = recording
    return depths


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parallel_greedy_parity_and_sharding(tiny_model_factory, arch, tp, pp):
    path = tiny_model_factory(arch)
    hf = _hf_model(path)
    llm = make_llm(path, tp, pp)
    executor = executor_of(llm)
    pg, actors = executor.group.placement_group, executor.group.actors
    try:
        assert type(executor).__name__ == "RayExecutor"
        assert executor.max_concurrent_batches == pp
        assert_sharded(llm, path, tp, pp)
        depths = record_batch_depth(llm)
        # A 16-token budget chunks the long prompts; the second round hits the shared prefix.
        shared = random_prompts(11, [13])[0]
        check_parity(llm, hf, random_prompts(12, [30, 5, 19], prefix=None) + random_prompts(13, [4, 9], shared))
        before = llm.get_stats().prefix_cache_hits
        check_parity(llm, hf, random_prompts(14, [6, 11], shared))
        assert llm.get_stats().prefix_cache_hits - before >= 2 * 12
        if pp > 1:
            # The engine handed out a new batch while pp - 1 earlier ones were still running.
            assert max(depths) == pp - 1
    finally:
        llm.shutdown()
    assert_group_released(pg, actors)


# ---- failures --------------------------------------------------------------------------------


def kill_rank_on_step(llm: LLM, rank: int, step: int, noticed_first: bool = False) -> None:
    """Kill one worker actor right after the engine submits its `step`-th batch (`noticed_first`: and wait
    until the worker group has noticed, so that the engine finds its executor failed with batches in flight)."""
    executor = executor_of(llm)
    submit = executor.execute_model_async
    calls = [0]

    def submit_then_kill(scheduler_output):
        future = submit(scheduler_output)
        calls[0] += 1
        if calls[0] == step:
            ray.kill(executor.group.actors[rank], no_restart=True)
            end = time.monotonic() + 60.0
            while noticed_first and not executor.is_failed and time.monotonic() < end:
                time.sleep(0.05)
            assert not noticed_first or executor.is_failed
        return future

    executor.execute_model_async = submit_then_kill


@pytest.mark.parametrize("noticed_first", [False, True], ids=["collected-first", "group-noticed-first"])
def test_killed_worker_fails_generate_and_releases_the_group(tiny_model_factory, noticed_first):
    """Whether the engine meets the death collecting a batch or the worker group notices it first (the
    engine then finds its executor failed with batches in flight), every request ends with the group's
    error and later requests are refused."""
    path = tiny_model_factory("llama")
    llm = make_llm(path, 1, 2)
    group = executor_of(llm).group
    pg, actors = group.placement_group, group.actors
    kill_rank_on_step(llm, rank=0, step=3, noticed_first=noticed_first)
    prompts = random_prompts(21, [12, 20, 7])
    # A request that fails while it runs comes back with finish_reason "error" (LLM.generate does not raise).
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outputs)
    assert any(re.search(r"WorkerGroupError: .*worker rank 0 .*died", o.error or "") for o in outputs)
    assert executor_of(llm).is_failed and executor_of(llm).group.failure.rank == 0
    assert_group_released(pg, actors)
    # The engine stays failed, and says so.
    with pytest.raises(RuntimeError, match="earlier failure"):
        llm.generate([{"prompt_token_ids": prompts[0]}], use_tqdm=False)
    llm.shutdown()

    # The freed resources are enough for a new engine, which works.
    fresh = make_llm(path, 2, 1)
    check_parity(fresh, _hf_model(path), prompts)
    group = executor_of(fresh).group
    pg, actors = group.placement_group, group.actors
    del fresh, group
    gc.collect()  # dropping the LLM without shutdown() still releases its group
    assert_group_released(pg, actors)


def _raise_on_rank_1(worker) -> int:
    if worker.rank == 1:
        raise ValueError("boom from the test")
    return worker.rank


def test_raising_worker_fails_the_call_and_shuts_the_group_down(tiny_model_factory):
    llm = make_llm(tiny_model_factory("llama"), 2, 1)
    group = executor_of(llm).group
    pg, actors = group.placement_group, group.actors
    with pytest.raises(WorkerGroupError, match=r"worker rank 1 .*raised ValueError: boom from the test"):
        executor_of(llm).collective_rpc(_raise_on_rank_1)
    assert_group_released(pg, actors)
    with pytest.raises(RuntimeError, match="earlier failure"):
        executor_of(llm).check_health()


# ---- small pieces ----------------------------------------------------------------------------


def test_ensure_ray_reuses_the_running_session():
    from pagedserve.cluster.executor.ray_utils import ensure_ray

    job = ray.get_runtime_context().get_job_id()
    ensure_ray(num_cpus=1)
    assert ray.get_runtime_context().get_job_id() == job
    assert ray.cluster_resources()["CPU"] == 4


def test_bad_group_options_name_the_field(tiny_model_factory):
    from pagedserve.cluster.executor.worker_group import WorkerGroupOptions
    from pagedserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="num_cpus_per_worker"):
        WorkerGroupOptions(num_cpus_per_worker=0)
    with pytest.raises(ValueError, match="placement_group_strategy"):
        WorkerGroupOptions(strategy="RANDOM")
    with pytest.raises(ValueError, match="placement_timeout_s"):
        WorkerGroupOptions(placement_timeout_s=0)
    with pytest.raises(ValueError, match="num_cpus_per_worker"):
        EngineConfig(model=str(tiny_model_factory("llama")), num_cpus_per_worker=0)


def test_placement_group_that_cannot_be_placed_is_removed(tiny_model_factory):
    from pagedserve.cluster.executor.worker_group import WorkerGroup, WorkerGroupOptions
    from pagedserve.engine.config import EngineConfig

    config = EngineConfig(model=str(tiny_model_factory("llama")), tensor_parallel_size=2).resolve()
    before = {pg_id for pg_id, info in placement_group_table().items() if info["state"] != "REMOVED"}
    # Two bundles of 3 CPUs do not fit a 4-CPU cluster.
    with pytest.raises(RuntimeError, match="placement group: the cluster did not offer 2 bundles"):
        WorkerGroup(config, WorkerGroupOptions(num_cpus_per_worker=3, placement_timeout_s=2))
    after = {pg_id for pg_id, info in placement_group_table().items() if info["state"] != "REMOVED"}
    assert after == before
