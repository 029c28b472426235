"""`pagedserve bench serve --chaos-kill-every S`: the same load again while an engine replica is killed
every S seconds, to price fault tolerance (cluster/serve/migration.py).

The killer reaches the app's engine replicas through Ray (the server this process started, or the
cluster `RAY_ADDRESS` names) and kills one at random (`ray.kill`, no restart: Serve replaces it).
Requests the dead replica held migrate; what the clients pay shows as the longest gap between two
tokens of a stream (a kill, its detection, the prefill of prompt + delivered tokens elsewhere), the
p99 figures and goodput, next to the run without kills.
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
        self.kills: list[float] = []  # monotonic times of the kills
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
            replicas = engine_replica_names(ray.util.list_named_actors(all_namespaces=True), self.app_name)
            if not replicas:
                logger.warning("chaos: no engine replica of app %r to kill", self.app_name)
                continue
            name, namespace = self.rng.choice(replicas)
            try:
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            except ValueError:  # it went away meanwhile
                continue
            self.kills.append(time.monotonic())
            logger.warning("chaos: killed %s", name)


def comparison(calm: dict[str, Any], chaos: dict[str, Any], num_kills: int) -> dict[str, Any]:
    """The figures of one rate's run without and with kills, side by side (ms, req/s)."""

    def figures(run: dict[str, Any]) -> dict[str, Any]:
        lat = run["latency_ms"]
        return {"completed": run["completed"], "failed": run["failed"],
                "goodput_requests_per_s": (run.get("goodput") or {}).get("requests_per_s"),
                "requests_per_s": run["throughput"]["requests_per_s"],
                "ttft_p99": (lat["ttft"] or {}).get("p99"), "tpot_p99": (lat["tpot"] or {}).get("p99"),
                "longest_stall": (lat["itl"] or {}).get("max")}

    return {"kills": num_kills, "without_kills": figures(calm), "with_kills": figures(chaos)}
