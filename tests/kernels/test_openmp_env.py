"""OpenMP's wait policy: PASSIVE by default, chosen before torch (and its libgomp) is imported, never over a
user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedserve.kernels.openmp_env import USER_SETTINGS, prefer_passive_openmp_wait


@pytest.fixture
def no_user_setting(monkeypatch):
    for name in USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)


def test_passive_unless_the_user_chose(no_user_setting, monkeypatch):
    assert prefer_passive_openmp_wait() is False  # torch is already imported in this process
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    prefer_passive_openmp_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # a spin count is a choice of waiting too
    prefer_passive_openmp_wait()
    assert "OMP_WAIT_POLICY" not in os.environ


# The environment at the moment torch is first imported (libgomp reads it when torch loads it).
PROBE = """
import importlib, json, os, sys
seen = {}
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "policy" not in seen:
            seen["policy"] = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Probe())
importlib.import_module(sys.argv[1])
print(json.dumps(seen))
"""


@pytest.mark.parametrize("module", ["pagedserve.engine", "pagedserve.kernels", "pagedserve.cluster.serve.engine_host"])
@pytest.mark.parametrize("user", [None, "ACTIVE"])
def test_the_policy_is_in_place_before_torch_loads(module, user):
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    if user is not None:
        env["OMP_WAIT_POLICY"] = user
    out = subprocess.run([sys.executable, "-c", PROBE, module], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"policy": user or "PASSIVE"}
