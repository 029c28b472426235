"""GPU placement decisions for engine actors and worker groups, on fake clusters (CPU only, no Ray started)."""

from __future__ import annotations

import os

import pytest

from pagedserve.cluster.executor import placement
from pagedserve.cluster.serve.engine_actor import engine_actor_options
from pagedserve.cluster.executor.placement import plan_engine_placement, restrict_to_assigned_gpus, uses_gpu
from pagedserve.cluster.executor.ray_executor import _use_gpu
from pagedserve.cluster.executor.worker_group import WorkerGroupOptions
from pagedserve.engine.config import EngineConfig

CPU_CLUSTER = {"CPU": 16.0, "memory": 1e10}
GPU_CLUSTER = {"CPU": 64.0, "GPU": 8.0}


@pytest.mark.parametrize(
    ("device", "cluster", "expected"),
    [("auto", CPU_CLUSTER, False), ("auto", GPU_CLUSTER, True), ("cpu", GPU_CLUSTER, False),
     ("cuda", CPU_CLUSTER, True), ("cuda", GPU_CLUSTER, True)],
)
def test_device_decision_needs_no_gpu_on_the_driver(device, cluster, expected):
    assert uses_gpu(device, cluster) is expected


def test_single_rank_engine_on_gpu_cluster_reserves_one_gpu_and_is_pinned_to_cuda():
    options, kwargs = engine_actor_options({"model": "m"}, 1.0, GPU_CLUSTER, max_restarts=3, max_concurrency=10)
    assert options["num_gpus"] == 1 and options["num_cpus"] == 1.0
    assert options["max_restarts"] == 3 and options["max_task_retries"] == 0 and options["max_concurrency"] == 10
    assert kwargs == {"model": "m", "device": "cuda"}


def test_engine_on_cpu_cluster_reserves_no_gpu_and_is_pinned_to_cpu():
    options, kwargs = engine_actor_options({"model": "m"}, 2.0, CPU_CLUSTER)
    assert options["num_gpus"] == 0 and kwargs["device"] == "cpu"
    options, kwargs = engine_actor_options({"model": "m", "device": "cpu"}, 2.0, GPU_CLUSTER)
    assert options["num_gpus"] == 0 and kwargs["device"] == "cpu"  # asked for CPU on a GPU cluster


def test_parallel_engine_leaves_gpus_to_its_worker_group_bundles():
    kwargs = {"model": "m", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    plan = plan_engine_placement(kwargs, GPU_CLUSTER)
    assert plan.device == "cuda" and plan.num_gpus == 0  # the actor itself holds none
    options, pinned = engine_actor_options(kwargs, 1.0, GPU_CLUSTER)
    assert options["num_gpus"] == 0 and pinned["device"] == "cuda"
    # ... and the group's executor, deciding from the pinned config, puts one GPU in every rank's bundle.
    assert _use_gpu(EngineConfig(**pinned))
    assert WorkerGroupOptions(num_cpus_per_worker=2, use_gpu=True).bundle() == {"CPU": 2, "GPU": 1}
    assert WorkerGroupOptions(use_gpu=False).bundle() == {"CPU": 1.0}


def test_executor_auto_device_asks_the_cluster(monkeypatch):
    monkeypatch.setattr("ray.cluster_resources", lambda: GPU_CLUSTER)
    assert _use_gpu(EngineConfig(model="m", tensor_parallel_size=2))
    monkeypatch.setattr("ray.cluster_resources", lambda: CPU_CLUSTER)
    assert not _use_gpu(EngineConfig(model="m", tensor_parallel_size=2))


class _FakeContext:
    def __init__(self, gpu_ids: list[str]) -> None:
        self.gpu_ids = gpu_ids

    def get_accelerator_ids(self) -> dict:
        return {"GPU": self.gpu_ids}


@pytest.mark.parametrize(("assigned", "before", "after"),
                         [(["3"], None, "3"), (["3"], "3", "3"), ([], None, ""), (["1", "2"], "0,1,2,3", "1,2")])
def test_actor_sees_exactly_its_assigned_gpus(monkeypatch, assigned, before, after):
    """Ray leaves CUDA_VISIBLE_DEVICES alone for a zero-GPU actor (it would see, and use, cuda:0) and
    under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the actor narrows it to what it reserved."""
    monkeypatch.setattr(placement, "_in_ray_actor", lambda: True)
    monkeypatch.setattr(placement.ray, "get_runtime_context", lambda: _FakeContext(assigned))
    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    restrict_to_assigned_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == after


def test_outside_an_actor_visible_gpus_are_left_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    restrict_to_assigned_gpus()  # the driver / a test process: no Ray actor
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_too_few_gpus_for_all_engines_is_logged(caplog):
    kwargs = {"model": "m", "device": "cuda", "tensor_parallel_size": 2}
    with caplog.at_level("WARNING", logger="pagedserve.cluster.executor.placement"):
        placement.warn_if_gpus_short(4, kwargs, GPU_CLUSTER)  # 4 engines x 2 ranks = 8 GPUs: enough
        assert not caplog.records
        placement.warn_if_gpus_short(5, kwargs, GPU_CLUSTER)
    assert "need 10 GPU(s)" in caplog.text


# --------------------------------------------------------------------------- can the cluster ever place it


def _rank(cpus: float, gpus: float = 0) -> dict:
    return {"CPU": cpus, "GPU": gpus}


@pytest.mark.parametrize(
    ("bundles", "strategy", "nodes", "expected"),
    [
        ([_rank(1)] * 4, "PACK", [{"CPU": 2}], False),  # TP2 x PP2 on one 2-CPU node
        ([_rank(0.5)] * 4, "PACK", [{"CPU": 2}], True),
        ([_rank(1)] * 4, "PACK", [{"CPU": 2}, {"CPU": 2}], True),  # PACK may span nodes
        ([_rank(1)] * 4, "SPREAD", [{"CPU": 2}, {"CPU": 2}], True),
        ([_rank(1)] * 4, "STRICT_PACK", [{"CPU": 2}, {"CPU": 2}], False),  # one node for all
        ([_rank(1)] * 2, "STRICT_SPREAD", [{"CPU": 8}], False),  # one node per bundle
        ([_rank(1)] * 2, "STRICT_SPREAD", [{"CPU": 1}, {"CPU": 1}], True),
        ([_rank(1, 1)] * 2, "PACK", [{"CPU": 64, "GPU": 1}], False),
        ([_rank(1, 1)] * 2, "PACK", [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}], True),
        # the replica's bundle beside its ranks: 1.5 + 3 x 1 CPUs over nodes of 2 and 3 CPUs
        ([_rank(1.5)] + [_rank(1)] * 3, "PACK", [{"CPU": 2}, {"CPU": 3}], True),
        ([_rank(1.5)] + [_rank(1)] * 4, "PACK", [{"CPU": 2}, {"CPU": 3}], False),
        ([_rank(1.5), _rank(1.5)], "PACK", [{"CPU": 2}, {"CPU": 1}], False),  # fits in sum, not per node
        ([], "PACK", [], True),
    ],
)
def test_can_place_is_exact_per_strategy(bundles, strategy, nodes, expected):
    assert placement.can_place(bundles, strategy, nodes) is expected


def test_unplaceable_layout_fails_at_once_naming_the_layout_and_the_offer():
    expected = r"tp=2 x pp=2.*never can: its 1 node\(s\): \{'CPU': 2.0\}.*num_cpus_per_worker"
    with pytest.raises(ValueError, match=expected):
        placement.check_placeable([_rank(1)] * 4, "PACK", "tp=2 x pp=2: 4 ranks of {'CPU': 1.0} each",
                                  "lower num_cpus_per_worker", nodes=[{"CPU": 2.0}], autoscales=False)


def test_unplaceable_layout_on_an_autoscaling_cluster_only_warns(caplog):
    with caplog.at_level("WARNING", logger="pagedserve.cluster.executor.placement"):
        placement.check_placeable([_rank(1)] * 4, "PACK", "tp=2 x pp=2", "fix", nodes=[{"CPU": 2.0}], autoscales=True)
    assert "waiting for the autoscaler" in caplog.text


def test_autoscaling_override_from_the_environment(monkeypatch):
    monkeypatch.setenv(placement.AUTOSCALING_ENV, "1")
    assert placement.cluster_autoscales()
    monkeypatch.setenv(placement.AUTOSCALING_ENV, "0")
    assert not placement.cluster_autoscales()


@pytest.mark.parametrize(("reserved", "node", "share"), [(0.5, 2, 0.25), (1, 3, 1 / 3), (4, 2, 1.0), (0, 4, 0.25)])
def test_kv_share_is_the_cpu_share_of_the_node(reserved, node, share):
    assert placement.kv_share_of_node(reserved, node) == pytest.approx(share)


def test_engine_kv_share_leaves_explicit_budgets_alone():
    kwargs = {"model": "m", "device": "cpu", "kv_cache_memory": "1GiB"}
    assert placement.with_engine_kv_share(kwargs, 1.0) == kwargs  # explicit budget (and not in a Ray actor)


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        (None, False),  # no monitor report yet
        ({"active_nodes": {"node_3c4f2e8bc1": 1}, "pending_launches": {}}, False),  # hand-started: read-only monitor
        ({"active_nodes": {"head": 1}, "pending_launches": {}}, True),  # ray up: named node types
        ({"active_nodes": {"headgroup": 1}, "pending_launches": {"cpu-workers": 1}}, True),  # KubeRay
    ],
)
def test_autoscaler_detection_reads_the_monitor_report(monkeypatch, report, expected):
    import json

    import ray.autoscaler.v2.utils
    import ray.experimental.internal_kv as kv

    monkeypatch.delenv(placement.AUTOSCALING_ENV, raising=False)
    monkeypatch.setattr(ray.autoscaler.v2.utils, "is_autoscaler_v2", lambda **_: False)
    monkeypatch.setattr(kv, "_internal_kv_initialized", lambda: True)
    status = {"load_metrics_report": {}} if report is None else {"autoscaler_report": report}
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key: json.dumps(status).encode())
    assert placement.cluster_autoscales() is expected
    monkeypatch.setattr(ray.autoscaler.v2.utils, "is_autoscaler_v2", lambda **_: True)
    assert placement.cluster_autoscales()
