"""A real multi-node Ray cluster on this one machine, for tests: a head and worker raylets, each node with
a custom resource naming it (`mn_<name>: 1`), the head with its dashboard (what `serve deploy` talks to).

The nodes are separate raylets (their own worker processes, object stores and resources) started through
`ray.cluster_utils.Cluster`; removing a node kills its raylet and every worker process on it, as a
machine failure would. Ray turns a loopback node IP into the host's own address, so the nodes listen on
this machine's address; every HTTP server a test starts still binds 127.0.0.1.

Everything started here stops in `close()` (and in `__exit__`), whatever the test did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

HEAD = "head"
RAY_BIN = Path(sys.executable).parent


def node_resource(name: str) -> str:
    return f"mn_{name}"


class LocalCluster:
    """Head + named worker nodes; the test process is connected to it as a driver."""

    def __init__(self, head_cpus: float, workers: dict[str, float], dashboard: bool = True) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from pagedserve.cluster.executor.ray_utils import free_port

        self._auth_mode = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"  # only for the cluster this test starts (restored by close)
        if ray.is_initialized():
            ray.shutdown()
        self.dashboard_port = free_port()
        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
            "num_cpus": head_cpus, "resources": {node_resource(HEAD): 1}, "include_dashboard": dashboard,
            "dashboard_host": "127.0.0.1", "dashboard_port": self.dashboard_port,
            "object_store_memory": 200 * 1024**2,
        })
        self.nodes: dict[str, Any] = {HEAD: self.cluster.head_node}
        self.worker_cpus = dict(workers)
        try:
            for name, cpus in workers.items():
                self.add_worker(name, cpus)
            ray.init(address=self.cluster.address, log_to_driver=False)
            self.wait_nodes(1 + len(workers))
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self.cluster.address

    def replica_nodes(self, app: str, deployment: str) -> list[str]:
        return replica_nodes(self.address, app, deployment)

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_worker(self, name: str, cpus: float | None = None) -> None:
        cpus = self.worker_cpus[name] if cpus is None else cpus
        self.worker_cpus[name] = cpus
        self.nodes[name] = self.cluster.add_node(num_cpus=cpus, resources={node_resource(name): 1},
                                                 object_store_memory=150 * 1024**2)

    def kill_worker(self, name: str) -> None:
        """Kill the node's raylet and every process on it (no graceful drain)."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def node_id(self, name: str) -> str:
        """The Ray node id of the live node named `name` (found by its custom resource)."""
        import ray

        key = node_resource(name)
        for node in ray.nodes():
            if node["Alive"] and node["Resources"].get(key):
                return node["NodeID"]
        raise LookupError(f"no live node named {name!r}")

    def node_names(self) -> dict[str, str]:
        """node id -> name, for the live nodes."""
        return {self.node_id(name): name for name in self.nodes}

    def wait_nodes(self, count: int, timeout_s: float = 180.0) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        while len([n for n in ray.nodes() if n["Alive"]]) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not reach {count} live nodes: {ray.nodes()}")
            time.sleep(0.5)

    def close(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                try:
                    from ray import serve

                    serve.shutdown()
                except Exception:  # noqa: BLE001 - Serve was never started, or the cluster is half down
                    pass
                ray.shutdown()
        finally:
            self.cluster.shutdown()
            if self._auth_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._auth_mode

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_deploy(config: dict, dashboard_url: str, timeout_s: float = 180.0) -> None:
    """`serve deploy <config.yaml> --address <dashboard>`, as a user runs it (a subprocess)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
        path = f.name
    try:
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        done = subprocess.run([str(RAY_BIN / "serve"), "deploy", path, "--address", dashboard_url], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"serve deploy failed ({done.returncode}): {done.stdout}\n{done.stderr}")
    finally:
        os.unlink(path)


def wait_apps_running(names: list[str], timeout_s: float = 420.0) -> None:
    """Poll Serve's status until every app is RUNNING (raise with its message if one fails to deploy)."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            apps = serve.status().applications
        except Exception:  # noqa: BLE001 - the controller is still starting
            apps = {}
        states = {name: (apps[name].status if name in apps else "MISSING") for name in names}
        if all(state == "RUNNING" for state in states.values()):
            return
        for name in names:
            if states[name] == "DEPLOY_FAILED":
                raise RuntimeError(f"app {name} failed to deploy: {apps[name].message}")
        if time.monotonic() > deadline:
            details = {name: json.dumps(apps[name].deployments, default=str)[:2000] for name in names if name in apps}
            raise TimeoutError(f"apps not RUNNING after {timeout_s:.0f}s: {states} {details}")
        time.sleep(1.0)


def replica_nodes(address: str, app: str, deployment: str) -> list[str]:
    """Node ids of the live replicas of one deployment, from Ray's state API (`ray list actors`) of the
    cluster at `address` (named: other Ray instances may run on this machine)."""
    from ray.util.state import list_actors

    class_name = f"ServeReplica:{app}:{deployment}"
    actors = list_actors(address=address, filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
                         detail=True, raise_on_missing_output=False)
    return sorted(actor.node_id for actor in actors)


@contextmanager
def local_cluster(head_cpus: float, workers: dict[str, float]) -> Iterator[LocalCluster]:
    cluster = LocalCluster(head_cpus, workers)
    try:
        yield cluster
    finally:
        cluster.close()


@contextmanager
def in_process_cluster(nodes: dict[str, tuple[float, dict[str, float]]]) -> Iterator[dict[str, str]]:
    """A Ray cluster of raylets in this process's reach (`ray.cluster_utils.Cluster`): a 1-CPU head and one
    node per entry (name -> (CPUs, custom resources)), this driver connected with one KV secret for every
    worker (the engines of one deployment share it: their KV reads are signed with it). Yields name -> node
    id; shuts Serve, Ray and the cluster down after."""
    import secrets as token_secrets

    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    added = {name: cluster.add_node(num_cpus=cpus, resources=resources) for name, (cpus, resources) in nodes.items()}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PAGEDSERVE_KV_SECRET": token_secrets.token_hex(32)}})
    try:
        yield {name: node.node_id for name, node in added.items()}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
