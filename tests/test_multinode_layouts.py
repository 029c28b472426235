"""Layouts against what a (local, 2-CPU) Ray cluster offers: a layout it can never place fails at once
with an error naming it; one that is merely busy waits a bounded placement_timeout_s; and without an
explicit KV budget the ranks / engines that share a node split one engine's default budget.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from pagedserve.engine.config import default_kv_cache_memory  # noqa: E402
from tests.local_ray import fresh_local_ray  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def two_cpu_ray():
    with fresh_local_ray(num_cpus=2):
        yield


@pytest.fixture(autouse=True)
def no_autoscaler_override(monkeypatch):
    from pagedserve.cluster.executor.placement import AUTOSCALING_ENV

    monkeypatch.delenv(AUTOSCALING_ENV, raising=False)


def test_tp2_pp2_on_two_cpus_fails_at_once_naming_layout_offer_and_fix(tiny_llama):
    from pagedserve.engine import LLM

    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_memory="8MiB")
    message = str(info.value)
    assert "tp=2 x pp=2" in message and "4 ranks of {'CPU': 1.0}" in message, message
    assert "1 node(s): {'CPU': 2.0}" in message and "no autoscaler" in message, message
    assert "num_cpus_per_worker" in message, message
    # It did not wait out the placement timeout (300 s by default) to say so.
    assert time.monotonic() - started < 300


def test_autoscaling_cluster_waits_bounded_instead(tiny_llama, monkeypatch, caplog):
    """Where nodes may still join, the same layout waits (placement_timeout_s), saying what it waits for."""
    from pagedserve.cluster.executor.placement import AUTOSCALING_ENV
    from pagedserve.engine import LLM

    monkeypatch.setenv(AUTOSCALING_ENV, "1")
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match=r"within 2s \(placement_timeout_s\)"):
        LLM(str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_memory="8MiB",
            placement_timeout_s=2)
    assert "waiting for the autoscaler" in caplog.text


def test_busy_cluster_waits_bounded_then_names_the_timeout(tiny_llama):
    """Placeable, but the CPUs are held: a bounded wait, then an error naming the knob."""
    from pagedserve.engine import LLM

    @ray.remote(num_cpus=2)
    class Holder:
        def ping(self) -> int:
            return 1

    holder = Holder.remote()
    try:
        ray.get(holder.ping.remote(), timeout=120)
        with pytest.raises(RuntimeError, match=r"did not offer 2 bundles .* within 3s \(placement_timeout_s\)"):
            LLM(str(tiny_llama), tensor_parallel_size=2, kv_cache_memory="8MiB", placement_timeout_s=3)
    finally:
        ray.kill(holder)


def test_serve_app_that_can_never_be_placed_fails_at_build(tiny_llama):
    from pagedserve.cluster.serve.app import build_app

    with pytest.raises(ValueError, match=r"tp=2 x pp=2, a bundle of \{'CPU': 1.0\} for the replica and 4 rank"):
        build_app({"model": str(tiny_llama), "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match=r"tp=1 x pp=1\) needing \{'CPU': 3.0, 'GPU': 0.0\}.*num_cpus_per_engine"):
        build_app({"model": str(tiny_llama), "num_cpus_per_engine": 3})
    build_app({"model": str(tiny_llama), "tensor_parallel_size": 2, "num_cpus_per_worker": 0.5,
               "num_cpus_per_engine": 0.5})  # fits: no error


@pytest.mark.slow
def test_tp2_pp2_with_default_kv_budget_splits_it_among_the_ranks(tiny_llama):
    """Four ranks on one 2-CPU node (0.5 CPU each), no kv_cache_memory: each rank budgets a quarter of the
    node's default, so together they stay within one engine's default; and the engine serves."""
    from pagedserve.engine import LLM, SamplingParams

    single = default_kv_cache_memory()
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2, num_cpus_per_worker=0.5,
              dtype="float32")
    try:
        executor = llm.llm_engine.engine_core.executor
        shares = executor.group.call_all(lambda worker: worker.config.kv_cache_memory_share)
        assert shares == [pytest.approx(0.25)] * 4
        allocated = executor.group.call_all(
            lambda worker: sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                               for k, v in worker.model_runner.kv_caches))
        # Each rank sized its cache from a quarter of the default as it stood then (the default follows the
        # memory available at each moment: allow a little for that), and all four add up to one default.
        assert all(a <= 1.05 * single / 4 for a in allocated), (allocated, single)
        assert sum(allocated) <= 1.05 * single, (allocated, single)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.engine_core.executor.shutdown()


@pytest.mark.slow
def test_three_dp_engines_on_one_node_split_the_default_kv_budget(tiny_llama):
    """DP=3 engine replicas on one 2-CPU node (0.5 CPU each), no kv_cache_memory: each takes its CPU share
    (a quarter) of the node's default budget, so the three together stay within one engine's default."""
    import httpx
    from ray import serve
    from transformers import AutoConfig

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server
    from pagedserve.cluster.settings import ServeArgs
    from tests.test_serve_scaleout import metric_samples

    # The default follows free RAM, which moves while engines start (and other processes run): bound each
    # engine by the larger of the figures measured before and after they sized their caches.
    single = default_kv_cache_memory()
    hf = AutoConfig.from_pretrained(tiny_llama)
    block = 16
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    bytes_per_block = 2 * hf.num_hidden_layers * block * kv_heads * head_dim * 4  # K and V, float32
    args = ServeArgs(model=str(tiny_llama), dtype="float32", block_size=block, port=free_port(), api_key=None,
                     served_model_name="tiny", data_parallel_size=3, num_cpus_per_engine=0.5, app_name="kvsplit",
                     routing_stats_period_s=0.2, graceful_shutdown_timeout_s=5)
    try:
        start_server(args)
        with httpx.Client(base_url=server_url(args), timeout=180) as http:
            response = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4})
            assert response.status_code == 200, response.text
            deadline = time.monotonic() + 120
            while True:
                totals = metric_samples(http.get("/metrics").text, "pagedserve:engine_kv_cache_total_blocks")
                if len(totals) == 3 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert len(totals) == 3, totals
        single = max(single, default_kv_cache_memory())
        allocated = [blocks * bytes_per_block for blocks in totals.values()]
        assert all(a <= 1.05 * single / 4 for a in allocated), (allocated, single)
        assert sum(allocated) <= 1.05 * single, (allocated, single)
    finally:
        serve.shutdown()
