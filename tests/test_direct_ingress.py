"""`pagedserve serve` on a Ray of its own: the ingress replica listens on --port itself (Serve's direct
ingress, cluster/serve/direct_ingress.py), comes back on the same port after it dies, and stops with the
server; `--no-direct-ingress` (and any shape direct ingress cannot serve) goes through Serve's proxy.

The server runs as the console script a user runs, on the bundled 12.6M model on loopback; every wait is
bounded and the process group is killed if anything is left. Which process listens on the port is read
from /proc (the socket's inode in /proc/net/tcp, then the process holding it).
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pagedserve.cluster.executor.ray_utils import free_port
from pagedserve.cluster.serve import direct_ingress
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.models.default_model import BUNDLED_MODEL_DIR

READY_TIMEOUT_S = 300
BACK_TIMEOUT_S = 120
STOP_TIMEOUT_S = 120


def test_direct_ingress_env_pins_serves_port_range_to_the_one_port():
    env = direct_ingress.direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve allocates from range(min, max): exactly the one port, reused at once, no load-balancer drain.
    assert (int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])) \
        == (8123, 8124)
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0" and env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_environment_is_restored_after_the_block(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_PORT_QUARANTINE_S", "90")
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    with direct_ingress.environment(direct_ingress.direct_ingress_env(9000)):
        assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and os.environ["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert os.environ["RAY_SERVE_PORT_QUARANTINE_S"] == "90" and "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ


def test_settings_refuse_direct_ingress_where_it_cannot_be(tiny_llama):
    with pytest.raises(ValueError, match="direct_ingress"):
        ServeArgs(model=str(tiny_llama), direct_ingress=True, num_ingress_replicas=2)
    with pytest.raises(ValueError, match="direct_ingress"):
        ServeArgs(model=str(tiny_llama), direct_ingress=True, address="10.0.0.1:6379")
    assert ServeArgs(model=str(tiny_llama), direct_ingress=True, address="local").direct_ingress  # a Ray of its own
    assert direct_ingress.wanted(ServeArgs(model=str(tiny_llama)))
    assert not direct_ingress.wanted(ServeArgs(model=str(tiny_llama), num_ingress_replicas=2))
    assert not direct_ingress.wanted(ServeArgs(model=str(tiny_llama), direct_ingress=False))
    # Asked for explicitly on a Ray this process did not start (here: none at all): a clear error.
    with pytest.raises(ValueError, match="direct_ingress: Serve's direct ingress needs a Ray"):
        direct_ingress.serves_directly(ServeArgs(model=str(tiny_llama), direct_ingress=True))
    assert not direct_ingress.serves_directly(ServeArgs(model=str(tiny_llama)))


def test_a_ray_started_with_direct_ingress_serves_its_port_directly_and_others_through_the_proxy(tiny_llama,
                                                                                                  monkeypatch):
    import types

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:6379"))
    monkeypatch.setattr(direct_ingress, "_started", direct_ingress._StartedRay("127.0.0.1:6379", 8123))
    model = str(tiny_llama)
    assert direct_ingress.serves_directly(ServeArgs(model=model, port=8123))
    assert direct_ingress.serves_directly(ServeArgs(model=model, port=8123, direct_ingress=True))
    # Another port (a server started again after serve.shutdown()): Serve's proxy serves it.
    assert not direct_ingress.serves_directly(ServeArgs(model=model, port=8124))
    # The proxy would take the port the ingress binds, or direct ingress is asked for on another port.
    with pytest.raises(ValueError, match="^direct_ingress: .* port 8123"):
        direct_ingress.serves_directly(ServeArgs(model=model, port=8123, direct_ingress=False))
    with pytest.raises(ValueError, match="^direct_ingress: "):
        direct_ingress.serves_directly(ServeArgs(model=model, port=8124, direct_ingress=True))
    with pytest.raises(ValueError, match="^num_ingress_replicas: "):  # Serve would have no port for the second
        direct_ingress.serves_directly(ServeArgs(model=model, port=8123, num_ingress_replicas=2))
    # That Ray shut down and another running: nothing of it is assumed.
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:7000"))
    assert not direct_ingress.serves_directly(ServeArgs(model=model, port=8123))


def test_serve_asked_for_direct_ingress_on_a_ray_it_did_not_start_fails_naming_the_field(tiny_llama, capsys):
    from pagedserve.cluster.cli import cmd_serve
    from tests.local_ray import fresh_local_ray

    with fresh_local_ray(num_cpus=1):  # a Ray already running in the process: Serve's proxy or nothing
        assert cmd_serve(ServeArgs(model=str(tiny_llama), port=free_port(), direct_ingress=True)) == 2
    assert "pagedserve serve: error: direct_ingress: Serve's direct ingress needs a Ray" in capsys.readouterr().err


def _listener(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on 127.0.0.1:`port`, or None."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            inode = fields[9]
            break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == target:
                    return int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return None


class _Server:
    """`pagedserve serve` in a process group of its own; its output collected by a reader thread."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.port = free_port()
        pagedserve = Path(sys.executable).with_name("pagedserve")
        assert pagedserve.is_file(), f"no console script at {pagedserve} (pip install -e . makes it)"
        # RAY_ADDRESS=local: a Ray of its own, never a cluster a `ray start` left running on this machine.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            [str(pagedserve), "serve", str(BUNDLED_MODEL_DIR), "--host", "127.0.0.1", "--port", str(self.port),
             "--kv-cache-memory", "64MiB", "--num-cpus-per-engine", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
            start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("pagedserve: ready at"):
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def complete(self, stream: bool = False, request_id: str = "") -> str:
        url = f"http://127.0.0.1:{self.port}/v1"
        with urllib.request.urlopen(f"{url}/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, "stream": stream}).encode()
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        request = urllib.request.Request(f"{url}/completions", body, headers)
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
            ids = resp.headers.get_all("x-request-id") or []
            assert len(ids) == 1 and (ids[0] == request_id or not request_id), ids  # honoured, returned once
            return resp.read().decode()

    def stop(self, sig: int = signal.SIGINT) -> int:
        os.killpg(self.proc.pid, sig)
        returncode = self.proc.wait(timeout=STOP_TIMEOUT_S)
        self.reader.join(timeout=30)
        return returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def test_serve_listens_on_its_port_from_the_ingress_replica_which_comes_back_after_a_kill(tmp_path):
    server = _Server(tmp_path)
    try:
        assert server.ready.wait(READY_TIMEOUT_S), server.output
        assert "the ingress replica serves HTTP itself" in server.output
        # Serve's own "is ready at" line would name its proxy's spare port; the line printed names the served one.
        ready = [ln for ln in server.output.splitlines() if " is ready at http" in ln]
        assert ready and all(f"127.0.0.1:{server.port}/" in ln for ln in ready), server.output
        listener = _listener(server.port)
        assert listener is not None, server.output
        pid, command = listener
        assert "ServeReplica" in command and "ingress" in command, command
        assert json.loads(server.complete(request_id="direct-1"))["usage"]["completion_tokens"] == 4
        events = [ln for ln in server.complete(stream=True).splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2

        # The ingress replica dies: Serve starts another, on the same port (released at once, no quarantine).
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + BACK_TIMEOUT_S
        while time.monotonic() < deadline:
            again = _listener(server.port)
            if again is not None and again[0] != pid:
                break
            time.sleep(1)
        else:
            pytest.fail(f"nothing new listens on port {server.port} {BACK_TIMEOUT_S} s after the ingress died")
        assert "ServeReplica" in again[1] and "ingress" in again[1], again
        deadline = time.monotonic() + BACK_TIMEOUT_S
        while True:  # listening comes before the replica's app is up
            try:
                assert json.loads(server.complete())["usage"]["completion_tokens"] == 4
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

        assert server.stop() == 0, server.output
        assert "pagedserve: shutting down" in server.output
        assert _listener(server.port) is None
    finally:
        server.kill()


def _session_members(sid: int) -> list[str]:
    """Command lines of the live processes of session `sid`."""
    members = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()  # state, ppid, pgrp, session, ...
            if proc.name.isdigit() and int(fields[3]) == sid and fields[0] != "Z":  # a zombie is already gone
                members.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return members


def test_sigterm_to_the_whole_process_group_stops_the_server_and_its_ray(tmp_path):
    """`timeout` and systemd's control-group stop signal every process of the group, the raylet the server
    started included: Serve's delete would then wait forever. The server exits 0 in bounded time and
    leaves no process of its Ray behind."""
    server = _Server(tmp_path)
    try:
        assert server.ready.wait(READY_TIMEOUT_S), server.output
        assert json.loads(server.complete())["usage"]["completion_tokens"] == 4
        assert server.stop(signal.SIGTERM) == 0, server.output
        assert "pagedserve: shutting down" in server.output
        assert _listener(server.port) is None
        deadline = time.monotonic() + 30
        while _session_members(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(1)
        assert _session_members(server.proc.pid) == [], server.output
    finally:
        server.kill()


def test_no_direct_ingress_serves_through_serves_proxy(tmp_path):
    server = _Server(tmp_path, "--no-direct-ingress")
    try:
        assert server.ready.wait(READY_TIMEOUT_S), server.output
        assert "the ingress replica serves HTTP itself" not in server.output
        listener = _listener(server.port)
        assert listener is not None and "ProxyActor" in listener[1], listener
        assert json.loads(server.complete())["usage"]["completion_tokens"] == 4
        assert server.stop() == 0, server.output
    finally:
        server.kill()


def test_bench_serve_start_server_on_a_ray_of_its_own_serves_directly_and_stops_quietly(tmp_path):
    """The bench's server runs as `pagedserve serve` does where the bench starts Ray (direct ingress), and
    leaves as the CLI leaves: apps deleted, then Ray shut down, nothing printed as a failed task."""
    pagedserve = Path(sys.executable).with_name("pagedserve")
    out = tmp_path / "serve.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [str(pagedserve), "bench", "serve", str(BUNDLED_MODEL_DIR), "--start-server", "--num-prompts", "4",
         "--input-len", "4:8", "--output-len", "3:5", "--request-rate", "inf", "--kv-cache-memory", "64MiB",
         "--no-roofline", "--output-json", str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=READY_TIMEOUT_S, start_new_session=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 4 and run["failed"] == 0
    assert "the server's ingress replica serves its port itself" in output, output
    assert not re.search(r"Traceback|failed|ray\.kill", output), output
