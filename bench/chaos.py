"""`pagedserve bench serve --chaos-kill-every S`: the same load again while an engine replica is killed
every S seconds, to price fault tolerance (cluster/serve/migration.py).

The killer reaches the app's engine replicas through Ray (the server this process started, or the
cluster `RAY_ADDRESS` names) and kills one at random (`ray.kill`, no restart: Serve replaces it), once
at least two are running (Serve's view): a kill always leaves a replica to migrate to, so that the
figures price migrations, not an outage of the whole fleet while Serve starts replacements.
Requests the dead replica held migrate; what the clients pay shows as the migration cost of each kill
(`migration_costs`: from the kill to the first token after the seam, in the slowest of the streams the
kill interrupted: its detection, the resubmission, the prefill of prompt + delivered tokens elsewhere),
the longest gap between two tokens of any stream, the p99 figures and goodput, next to the run without
kills.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chaos (needs --start-server, or RAY_ADDRESS naming the server's Ray cluster)")
    g.add_argument("--chaos-kill-every", type=float, default=None, metavar="S",
                   help="run the load a second time while an engine replica is killed every S seconds")
    g.add_argument("--app-name", default="pagedserve", help="the Serve app whose engine replicas are killed")


def check_chaos_args(ns: argparse.Namespace) -> None:
    if ns.chaos_kill_every is None:
        return
    if not ns.chaos_kill_every > 0:
        raise ValueError(f"--chaos-kill-every: must be > 0 seconds, got {ns.chaos_kill_every}")
    if not ns.start_server and not os.environ.get("RAY_ADDRESS"):
        raise ValueError("--chaos-kill-every: needs --start-server, or RAY_ADDRESS naming the server's Ray cluster")


def engine_replica_names(actors: list[dict[str, Any]], app_name: str) -> list[tuple[str, str]]:
    """(name, namespace) of the app's engine replica actors (`SERVE_REPLICA::<app>#<app>-engine#<id>`)."""
    marker = f"#{app_name}-engine#"
    return [(a["name"], a["namespace"]) for a in actors if marker in a["name"]]


class ReplicaKiller:
    """Kills one of the app's engine replicas every `every_s` seconds while in its `with` block."""

    def __init__(self, app_name: str, every_s: float, seed: int = 0) -> None:
        self.app_name = app_name
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.kills: list[float] = []  # time.perf_counter() of the kills (the load generator's clock)
        self._observed = 0  # kills already credited to a run (`observe`)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-killer", daemon=True)

    def __enter__(self) -> ReplicaKiller:
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level=logging.WARNING)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.every_s):
            if not self._wait_for_a_survivor():
                continue
            replicas = engine_replica_names(ray.util.list_named_actors(all_namespaces=True), self.app_name)
            if not replicas:
                logger.warning("chaos: no engine replica of app %r to kill", self.app_name)
                continue
            name, namespace = self.rng.choice(replicas)
            try:
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            except ValueError:  # it went away meanwhile
                continue
            self.kills.append(time.perf_counter())
            logger.warning("chaos: killed %s", name)


    def _wait_for_a_survivor(self) -> bool:
        """Wait (while not stopped) until two engine replicas run; False when stopped first."""
        while not self._stop.is_set():
            try:
                if running_engine_replicas(self.app_name) >= 2:
                    return True
            except Exception as exc:  # noqa: BLE001 - the controller is busy; ask again
                logger.debug("chaos: serve.status() failed: %s", exc)
            self._stop.wait(1.0)
        return False

    def observe(self, load: Any, run: dict[str, Any]) -> None:
        """`bench.serve_load.sweep`'s hook: the kills since the last run ended and their migration costs,
        into this run's report entry."""
        kills = self.kills[self._observed:]
        self._observed += len(kills)
        costs = migration_costs(kills, [r.token_times for r in load.results])
        run["chaos"] = {"kills": len(kills), "kills_interrupting_streams": len(costs),
                        "migration_cost_ms": _summary([c * 1e3 for c in costs])}


def migration_costs(kills: list[float], token_times: list[list[float]]) -> list[float]:
    """Per kill (a time), the seconds from it to the first token after it in the slowest of the streams
    it interrupted (those with tokens before and after it): a migrated stream resumes only once its
    continuation has been prefilled elsewhere, the others within one inter-token gap. A kill that
    interrupted no stream (between runs, or of an idle replica) is left out."""
    costs = []
    for kill in kills:
        waits = [next(t for t in times if t > kill) - kill for times in token_times
                 if times and times[0] < kill < times[-1]]
        if waits:
            costs.append(max(waits))
    return costs


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"count": len(ordered), "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def running_engine_replicas(app_name: str) -> int:
    """The app's engine replicas Serve reports RUNNING (0 when it does not know the app)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    deployment = app.deployments.get(f"{app_name}-engine") if app is not None else None
    return deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0


def comparison(calm: dict[str, Any], chaos: dict[str, Any]) -> dict[str, Any]:
    """The figures of one rate's run without and with kills, side by side (ms, req/s), the kills and
    their migration costs (`ReplicaKiller.observe`)."""

    def figures(run: dict[str, Any]) -> dict[str, Any]:
        lat = run["latency_ms"]
        return {"completed": run["completed"], "failed": run["failed"],
                "goodput_requests_per_s": (run.get("goodput") or {}).get("requests_per_s"),
                "requests_per_s": run["throughput"]["requests_per_s"],
                "ttft_p99": (lat["ttft"] or {}).get("p99"), "tpot_p99": (lat["tpot"] or {}).get("p99"),
                "longest_stall": (lat["itl"] or {}).get("max")}

    seen = chaos.get("chaos") or {}
    return {"kills": seen.get("kills", 0), "kills_interrupting_streams": seen.get("kills_interrupting_streams", 0),
            "migration_cost_ms": seen.get("migration_cost_ms"),
            "without_kills": figures(calm), "with_kills": figures(chaos)}
