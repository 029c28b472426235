"""The PD pools autoscale independently, on their own signals (`pd_autoscaling`), live on loopback: a
prefill-heavy burst (long prompts, one token each: the prefill answers alone) grows the prefill
deployment (min 1, max 2) and not decode; a decode-heavy burst (short prompts, long outputs) grows
decode and not prefill; both shrink back after; no request fails. Small delays and look-back window,
tiny model, explicit small KV caches; every wait is bounded. Growing waits for Serve to start a new
engine replica, minutes on two busy cores: the module is `slow` (`make test-slow`).
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from pagedserve.cluster.settings import ServeArgs
from tests.pd_local import MODEL_NAME

pytestmark = pytest.mark.slow

APP = "pdscale"
TIMEOUT = 600.0  # a request may wait for a replica that is still loading its model


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server

    model = str(tiny_model_factory("llama", max_position_embeddings=2048))
    if ray.is_initialized():
        ray.shutdown()
    # Replicas push their custom autoscaling metrics every 0.5 s (Serve's default is 10 s).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}})
    args = ServeArgs(model=model, dtype="float32", kv_cache_memory="8MiB", block_size=4, port=free_port(),
                     served_model_name=MODEL_NAME, api_key=None, max_num_seqs=16, app_name=APP,
                     num_cpus_per_engine=0.5, routing_stats_period_s=0.2, graceful_shutdown_timeout_s=30,
                     num_prefill_engines=1, num_decode_engines=1, prefill_min_replicas=1, prefill_max_replicas=2,
                     decode_min_replicas=1, decode_max_replicas=2, prefill_target_queued_prompt_tokens=64,
                     decode_target_num_seqs=2, decode_target_kv_usage=1.0, upscale_delay_s=0.5,
                     downscale_delay_s=3.0, autoscaling_look_back_period_s=2.0,
                     kv_connector_extra_config={"read_timeout_s": 20})
    try:
        start_server(args)
        with httpx.Client(base_url=server_url(args), timeout=TIMEOUT) as http:
            yield http
    finally:
        serve.shutdown()
        ray.shutdown()


def running(pool: str) -> int:
    from ray import serve

    return serve.status().applications[APP].deployments[f"{APP}-{pool}"].replica_states.get("RUNNING", 0)


class Burst:
    """Clients sending one kind of request back to back until stopped; every answer is recorded."""

    def __init__(self, http: httpx.Client, clients: int, prompt_len: int, max_tokens: int) -> None:
        self.http, self.prompt_len, self.max_tokens = http, prompt_len, max_tokens
        self.stop = threading.Event()
        self.codes: list[tuple[int, str]] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, client: int) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = [(31 * client + 7 * i + k) % 470 + 20 for k in range(self.prompt_len)]
            try:
                response = self.http.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                    "ignore_eos": True})
            except httpx.HTTPError as exc:
                self.codes.append((0, repr(exc)))
            else:
                self.codes.append((response.status_code, response.text[:200]))
            i += 1

    def finish(self) -> list[tuple[int, str]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=TIMEOUT)
        return self.codes


def grows(http: httpx.Client, pool: str, other: str, burst: Burst, deadline_s: float = 400.0) -> None:
    """Under the burst, `pool` reaches 2 running replicas while `other` stays at 1."""
    end = time.monotonic() + deadline_s
    try:
        while running(pool) < 2:
            assert running(other) == 1, f"{other} grew under a {pool}-heavy burst"
            assert time.monotonic() < end, f"{pool} did not grow under its burst"
            time.sleep(0.5)
        time.sleep(2.0)  # requests on the new replica too
        assert running(other) == 1, f"{other} grew under a {pool}-heavy burst"
    finally:
        codes = burst.finish()
    assert codes and all(code == 200 for code, _ in codes), [c for c in codes if c[0] != 200][:3]


def shrinks(deadline_s: float = 300.0) -> None:
    end = time.monotonic() + deadline_s
    while running("prefill") != 1 or running("decode") != 1:
        assert time.monotonic() < end, f"the pools did not shrink: {running('prefill')}, {running('decode')}"
        time.sleep(0.5)


def test_prefill_heavy_burst_grows_prefill_only_and_it_shrinks_after(server):
    grows(server, "prefill", "decode", Burst(server, clients=6, prompt_len=120, max_tokens=1))
    shrinks()


def test_decode_heavy_burst_grows_decode_only_and_it_shrinks_after(server):
    grows(server, "decode", "prefill", Burst(server, clients=6, prompt_len=5, max_tokens=200))
    shrinks()
