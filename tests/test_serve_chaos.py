"""Chaos (slow, bounded: about six minutes on two cores): mixed load on the Serve app (two engine replicas,
two ingress replicas) while an engine replica is killed every 30 s and the ingress replicas are
restarted once (a rolling restart: Serve's graceful path). Zero failed requests; every greedy and
seeded output equals its reference from the calm phase; the p50/p99 latency of the calm and the chaos
phase are printed side by side (the latency cost of the faults).

The load: a fixed set of requests (streamed and not, greedy and seeded, n = 2, 24 to 160 tokens) sent
over and over by four client threads; the calm phase's first answer to each is its reference, and every
later answer, calm or not, must equal it.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serve_apps import (
    assert_same, deploy_config, engine_replicas, run, serve_app, wait_app_running, wait_engines_running,
)

pytestmark = pytest.mark.slow

APP = "chaos"
TIMEOUT = 120.0
CALM_S = 45.0
CHAOS_S = 180.0
KILL_EVERY_S = 30.0
CLIENTS = 4
PROMPTS = [[(23 * i + 11 * k) % 400 + 10 for k in range(6 + 3 * i)] for i in range(12)]
BODIES = [{"prompt": PROMPTS[i], "max_tokens": 24 + 12 * i, "ignore_eos": True, "stream": i % 3 != 2,
           **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}),
           **({"n": 2} if i == 5 else {})} for i in range(len(PROMPTS))]


def load(http: httpx.Client, seconds: float, outcomes: list, stop: threading.Event | None = None) -> None:
    """CLIENTS threads sending BODIES round-robin for `seconds`: (body index, result, seconds) each."""
    end = time.monotonic() + seconds
    lock = threading.Lock()
    counter = iter(range(10**9))

    def client() -> None:
        while time.monotonic() < end and not (stop and stop.is_set()):
            with lock:
                index = next(counter) % len(BODIES)
            start = time.monotonic()
            try:
                result = run(http, BODIES[index])
            except Exception as exc:  # noqa: BLE001 - a failed request: reported by the assertions
                result = {"status": None, "errors": [repr(exc)], "choices": {}}
            with lock:
                outcomes.append((index, result, time.monotonic() - start))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 2 * TIMEOUT)
        assert not thread.is_alive(), "a client thread did not finish"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Chaos:
    """Kills an engine replica every KILL_EVERY_S (once two are running: one always survives) and
    restarts the ingress replicas once, halfway."""

    def __init__(self, args) -> None:
        self.args = args
        self.kills: list[str] = []
        self.ingress_restarts = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import ray

        try:
            start = time.monotonic()
            next_kill = start + 10.0
            while not self.stop.wait(0.5):
                now = time.monotonic()
                if not self.ingress_restarts and now - start > CHAOS_S / 2:
                    # A changed ingress actor option: Serve replaces its replicas one by one, each draining.
                    deploy_config(self.args, deployments=[{"name": f"{APP}-ingress",
                                                           "ray_actor_options": {"num_cpus": 0.001}}])
                    self.ingress_restarts += 1
                if now >= next_kill:
                    wait_engines_running(APP, 2, deadline_s=150.0)
                    name, victim = engine_replicas(APP)[0]
                    ray.kill(victim, no_restart=True)
                    self.kills.append(name)
                    next_kill = time.monotonic() + KILL_EVERY_S
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)


def test_kills_and_an_ingress_restart_under_mixed_load_fail_no_request(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=2048)
    with serve_app(model, declarative=True, app_name=APP, data_parallel_size=2, num_ingress_replicas=2,
                   graceful_shutdown_timeout_s=5, max_migrations=3) as args:
        from pagedserve.cluster.serve.app import server_url

        with httpx.Client(base_url=server_url(args), timeout=TIMEOUT) as http:
            calm: list = []
            load(http, CALM_S, calm)
            want: dict[int, dict] = {}
            for index, result, _ in calm:
                want.setdefault(index, result)
                assert_same(result, want[index], f"calm request {index}")
            assert len(want) == len(BODIES), "the calm phase did not send every request once"

            chaos = Chaos(args)
            chaos.thread.start()
            stormy: list = []
            try:
                load(http, CHAOS_S, stormy)
            finally:
                chaos.stop.set()
                chaos.thread.join(200.0)
            assert not chaos.errors, chaos.errors
            failed = [(i, r) for i, r, _ in stormy if r["status"] != 200 or r["errors"]]
            assert not failed, f"{len(failed)} of {len(stormy)} requests failed: {failed[:3]}"
            for index, result, _ in stormy:
                assert_same(result, want[index], f"chaos request {index}")
            assert len(chaos.kills) >= 3 and chaos.ingress_restarts == 1, (chaos.kills, chaos.ingress_restarts)

            calm_s = [s for _, _, s in calm]
            chaos_s = [s for _, _, s in stormy]
            print(f"\nchaos: {len(chaos.kills)} engine replicas killed, the ingress restarted once; "
                  f"{len(stormy)} requests, none failed\n"
                  f"latency (s)    calm ({len(calm_s)})   chaos ({len(chaos_s)})   cost\n"
                  f"  p50          {percentile(calm_s, 0.5):8.2f}   {percentile(chaos_s, 0.5):8.2f}   "
                  f"{percentile(chaos_s, 0.5) - percentile(calm_s, 0.5):+.2f}\n"
                  f"  p99          {percentile(calm_s, 0.99):8.2f}   {percentile(chaos_s, 0.99):8.2f}   "
                  f"{percentile(chaos_s, 0.99) - percentile(calm_s, 0.99):+.2f}")
            wait_app_running(APP)
