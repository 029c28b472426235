"""`ray up` / `ray down` for real, with the `local` provider against 127.0.0.1 (slow: about two minutes).

The test runs sshd on loopback (`tests/multinode_sshd.py`: a throwaway user and key) and a cluster YAML
shaped like manifests/ray-cluster-local.yaml: `ray up` reaches the head over SSH, syncs the file mounts (a
tiny model and the Serve config), runs the setup and head start commands (`ray start --head`, then
`serve deploy` of the Serve config through the app builder), the test asks the deployed app for a
completion over HTTP, and `ray down` stops it. The "remote" environment: setup_commands make the node
user a venv on the system Python that reads this checkout's installed packages (the checkout's own
interpreter is not readable by other users; installing torch over the network is out of a test's reach).

Run it: `.venv/bin/python -m pytest -q -m slow tests/test_multinode_rayup.py` (or `make test-slow`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pagedserve.cluster.executor.ray_utils import free_port
from tests.multinode_sshd import LoopbackSSH, missing_requirements

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")
VENV_BIN = str(Path(sys.executable).parent)
SITE_PACKAGES = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
# Run by `ray up` on the node (setup_commands): a venv on the system Python 3.11 that adds this checkout's
# site-packages (with pagedserve's editable install), and `ray` / `serve` entry points in it.
NODE_SETUP = """set -e
test -x ~/venv/bin/python || /usr/bin/python3.11 -m venv --without-pip ~/venv
echo "import site; site.addsitedir('{site}')" > ~/venv/lib/python3.11/site-packages/pagedserve-checkout.pth
printf '#!%s\\nimport sys\\nfrom ray.scripts.scripts import main\\nsys.exit(main())\\n' ~/venv/bin/python > ~/venv/bin/ray
printf '#!%s\\nimport sys\\nfrom ray.serve.scripts import cli\\nsys.exit(cli())\\n' ~/venv/bin/python > ~/venv/bin/serve
chmod +x ~/venv/bin/ray ~/venv/bin/serve
~/venv/bin/python -c 'import pagedserve.cluster.serve.app'
"""


@pytest.fixture
def ssh(tmp_path):
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    if not Path("/usr/bin/python3.11").exists() or sys.version_info[:2] != (3, 11):
        pytest.skip("the node's venv is made on the system Python 3.11 over this checkout's 3.11 packages")
    bashrc = ("export PATH=$HOME/venv/bin:$PATH RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false\n"
              "export RAY_USAGE_STATS_ENABLED=0\n")
    server = LoopbackSSH(tmp_path, bashrc)
    try:
        yield server
    finally:
        server.close()


def ray_temp_dir(ssh: LoopbackSSH) -> str:
    """The head's Ray temp dir (its own: /tmp/ray belongs to the machine's other Ray instances)."""
    return f"/tmp/psr-{ssh.user[-8:]}"


def cluster_yaml(ssh: LoopbackSSH, tmp_path: Path, model: Path, serve_config: Path, ports: dict[str, int]) -> Path:
    """A local-provider cluster YAML for this machine (no `ray stop`: the start commands name every port, so
    this head shares the machine with other Ray instances; `ray down` stops only the throwaway user's)."""
    temp_dir = ray_temp_dir(ssh)
    setup = tmp_path / "setup_node.sh"
    setup.write_text(NODE_SETUP.format(site=SITE_PACKAGES))
    start = (f"ray start --head --port={ports['gcs']} --dashboard-host=127.0.0.1 --dashboard-port={ports['dashboard']} "
             f"--ray-client-server-port={ports['client']} --dashboard-agent-listen-port={ports['agent']} "
             f"--dashboard-agent-grpc-port={ports['agent_grpc']} --metrics-export-port={ports['metrics']} "
             f"--runtime-env-agent-port={ports['runtime_env']} --num-cpus=2 --temp-dir={temp_dir} "
             "--disable-usage-stats")
    deploy = (f"(for i in $(seq 60); do serve deploy ~/serve.yaml --address http://127.0.0.1:{ports['dashboard']} "
              "&& exit 0; sleep 2; done; exit 1)")
    config = {
        "cluster_name": f"pagedserve-{ssh.user}",
        "provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
        "auth": {"ssh_user": ssh.user, "ssh_private_key": str(ssh.key), "ssh_proxy_command": str(ssh.proxy)},
        "min_workers": 0,
        "max_workers": 0,
        "file_mounts": {"~/model": str(model), "~/serve.yaml": str(serve_config), "~/setup_node.sh": str(setup)},
        "initialization_commands": [],
        "setup_commands": ["bash ~/setup_node.sh"],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [start, deploy],
        "worker_start_ray_commands": [],
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_ray_up_local_provider_serves_then_ray_down(ssh, tmp_path, tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=512)
    http_port = free_port()
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "agent", "agent_grpc", "metrics",
                                            "runtime_env")}
    serve_config = tmp_path / "serve.yaml"
    serve_config.write_text(yaml.safe_dump({
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [{"name": "pagedserve", "route_prefix": "/",
                          "import_path": "pagedserve.cluster.serve.app:build_app",
                          "args": {"model": str(ssh.home / "model"), "served_model_name": "tiny",
                                   "dtype": "float32", "kv_cache_memory": "8MiB", "block_size": 4,
                                   "num_cpus_per_engine": 1}}],
    }))
    config = cluster_yaml(ssh, tmp_path, model, serve_config, ports)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    up = None
    try:
        up = subprocess.run([RAY, "up", "-y", "--no-config-cache", str(config)], env=env, capture_output=True,
                            text=True, timeout=600)
        assert up.returncode == 0, f"ray up failed:\n{up.stdout[-6000:]}\n{up.stderr[-6000:]}"
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as http:
            while True:
                try:
                    response = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8],
                                                                  "max_tokens": 4, "temperature": 0})
                    if response.status_code == 200:
                        break
                except httpx.TransportError:
                    response = None
                assert time.monotonic() < deadline, f"the deployed app never answered: {response and response.text}"
                time.sleep(2)
            body = response.json()
            assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 4, body
        # The head is the throwaway user's: its Ray processes run as that user.
        assert ssh.user_pids()
    finally:
        down = subprocess.run([RAY, "down", "-y", str(config)], env=env, capture_output=True, text=True, timeout=300)
        state = Path(f"/tmp/cluster-pagedserve-{ssh.user}.state")
        for leftover in (state, state.with_suffix(".lock")):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(ray_temp_dir(ssh), ignore_errors=True)
    assert down.returncode == 0, f"ray down failed:\n{down.stdout[-4000:]}\n{down.stderr[-4000:]}"
    deadline = time.monotonic() + 60
    while any("raylet" in _cmdline(pid) or "gcs_server" in _cmdline(pid) for pid in ssh.user_pids()):
        assert time.monotonic() < deadline, "ray down left the head's Ray processes running"
        time.sleep(1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""
