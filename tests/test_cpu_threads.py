"""torch threads of a worker: `cpu_threads` (EngineConfig, LLM, --cpu-threads) sets them; inside a Ray
actor the default is the CPUs the actor reserved, even where the actor inherited OMP_NUM_THREADS=1
(Ray then leaves that variable, and so torch's thread count, alone)."""

from __future__ import annotations

import argparse

import pytest
import torch
from pydantic import ValidationError

from pagedserve.engine import LLM
from pagedserve.engine.config import EngineConfig


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_cpu_threads_is_validated_by_name(tiny_llama):
    with pytest.raises(ValidationError, match="cpu_threads"):
        EngineConfig(model=str(tiny_llama), cpu_threads=0)
    assert EngineConfig(model=str(tiny_llama)).cpu_threads is None


def test_llm_worker_sets_its_threads(tiny_llama, restore_threads):
    torch.set_num_threads(2)
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", cpu_threads=1)
    try:
        assert torch.get_num_threads() == 1
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0]
        assert out.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_cpu_threads_flags(tiny_llama):
    from pagedserve.bench import common
    from pagedserve.cluster.cli import build_parser, serve_args_from

    for command in (["serve"], ["generate", "--prompt", "x"]):
        ns = build_parser().parse_args([*command, str(tiny_llama), "--cpu-threads", "3"])
        assert serve_args_from(ns).engine_kwargs()["cpu_threads"] == 3
    parser = argparse.ArgumentParser()
    common.add_engine_args(parser)
    assert common.engine_kwargs(parser.parse_args(["--cpu-threads", "2"]))["cpu_threads"] == 2
    assert "cpu_threads" not in common.engine_kwargs(parser.parse_args([]))


def test_engine_actor_uses_the_cpus_it_reserved(tiny_llama, monkeypatch):
    ray = pytest.importorskip("ray")
    from pagedserve.cluster.serve.engine_actor import start_engine_actors, wait_engines_ready
    from tests.local_ray import fresh_local_ray

    # Inherited by the raylet and its workers: Ray keeps it, so without our default the actor runs 1 thread.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    kwargs = dict(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", block_size=4)
    with fresh_local_ray(num_cpus=3):
        reserved = start_engine_actors(kwargs, data_parallel_size=1, num_cpus_per_engine=2, name_prefix="threads-a")
        explicit = start_engine_actors({**kwargs, "cpu_threads": 1}, data_parallel_size=1, num_cpus_per_engine=1,
                                       name_prefix="threads-b")
        try:
            (reserved_info,) = wait_engines_ready(reserved, timeout_s=300)
            (explicit_info,) = wait_engines_ready(explicit, timeout_s=300)
            assert reserved_info["torch_threads"] == 2
            assert explicit_info["torch_threads"] == 1
            engine = reserved[0]
            assert ray.get(engine.ready.remote())["torch_threads"] == 2  # asked again, from another call
        finally:
            for handle in reserved + explicit:
                ray.kill(handle, no_restart=True)
