"""A Ray instance pagedserve starts itself gives its processes Serve's settings (`ray_utils.LOCAL_RAY_ENV`:
the HTTP proxy on Serve's gRPC transport), an operator's own value wins, and the starting process's
environment is left as it was. Run in a subprocess: a Ray instance of its own, whatever this one runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from pagedserve.cluster.executor.ray_utils import LOCAL_RAY_ENV  # noqa: E402

SCRIPT = """
import json, os, ray
from pagedserve.cluster.executor.ray_utils import LOCAL_RAY_ENV, init_local_ray
init_local_ray(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
@ray.remote(num_cpus=0)
def seen():
    return {name: os.environ.get(name) for name in LOCAL_RAY_ENV}
print("RESULT", json.dumps({"worker": ray.get(seen.remote()),
                            "driver": {name: os.environ.get(name) for name in LOCAL_RAY_ENV}}))
ray.shutdown()
"""


def run_script(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_RAY_ENV and k != "RAY_ADDRESS"}
    env.update({"RAY_AUTH_MODE": "disabled", **extra_env})
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_a_local_ray_gives_its_workers_serves_settings_and_leaves_ours_alone():
    assert LOCAL_RAY_ENV == {"RAY_SERVE_PROXY_USE_GRPC": "1"}
    got = run_script({})
    assert got["worker"] == LOCAL_RAY_ENV
    assert got["driver"] == dict.fromkeys(LOCAL_RAY_ENV)


def test_the_operators_own_value_wins():
    got = run_script({"RAY_SERVE_PROXY_USE_GRPC": "0"})
    assert got["worker"] == {"RAY_SERVE_PROXY_USE_GRPC": "0"}
    assert got["driver"] == {"RAY_SERVE_PROXY_USE_GRPC": "0"}
