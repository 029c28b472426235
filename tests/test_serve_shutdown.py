"""Ctrl-C on `pagedserve serve` stops it quietly (issue 34).

`serve.shutdown()` kills Serve's controller while its own calls to it are pending, and Ray prints each
as a failed task ("ServeController.listen_for_change failed ... killed by `ray.kill`") after "shutting
down". The CLI deletes its app and then leaves Ray instead. The test runs the console script as a user
does, on the bundled 12.6M model on loopback, and sends SIGINT to its process group, as a terminal's
Ctrl-C does; every wait is bounded and the process group is killed if anything is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pagedserve.cluster.executor.ray_utils import free_port
from pagedserve.engine.models.default_model import BUNDLED_MODEL_DIR

READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120


def test_ctrl_c_stops_serve_with_status_0_and_nothing_alarming(tmp_path):
    pagedserve = Path(sys.executable).with_name("pagedserve")
    assert pagedserve.is_file(), f"no console script at {pagedserve} (pip install -e . makes it)"
    # RAY_ADDRESS=local: a Ray of its own, never a cluster a `ray start` left running on this machine.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [str(pagedserve), "serve", str(BUNDLED_MODEL_DIR), "--host", "127.0.0.1", "--port", str(free_port()),
         "--kv-cache-memory", "64MiB", "--num-cpus-per-engine", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pagedserve: ready at"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(READY_TIMEOUT_S), "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)
        returncode = proc.wait(timeout=STOP_TIMEOUT_S)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    output = "".join(lines)
    assert returncode == 0, output
    assert "pagedserve: shutting down" in output
    assert not re.search(r"Traceback|failed|ray\.kill", output), output


def test_stop_server_deletes_every_app_then_leaves_ray(monkeypatch):
    """`stop_server(None)` (the bench's own server): every app of this Serve deleted, then Ray left."""
    import ray
    from ray import serve

    from pagedserve.cluster.serve import app as app_module

    deleted: list[str] = []
    left: list[bool] = []
    monkeypatch.setattr(serve, "status", lambda: type("S", (), {"applications": {"a": None, "b": None}})())
    monkeypatch.setattr(serve, "delete", deleted.append)
    monkeypatch.setattr(ray, "shutdown", lambda: left.append(True))
    assert app_module.stop_server(None, timeout_s=30.0) is True
    assert deleted == ["a", "b"] and left == [True]


def test_stop_server_gives_up_on_a_delete_that_never_returns(monkeypatch, caplog):
    """A Serve that never answers (its raylet gone with the process group) does not hold the stop: after
    `timeout_s` Ray is left all the same, with a warning that says so."""
    import time

    import ray
    from ray import serve

    from pagedserve.cluster.serve import app as app_module

    never = threading.Event()
    left: list[bool] = []
    monkeypatch.setattr(serve, "status", lambda: never.wait() and None)
    monkeypatch.setattr(ray, "shutdown", lambda: left.append(True))
    monkeypatch.setattr(app_module, "_started_ray_process_died", lambda: False)
    start = time.monotonic()
    try:
        assert app_module.stop_server(None, timeout_s=1.0) is False
    finally:
        never.set()  # the abandoned delete thread ends
    assert time.monotonic() - start < 10.0  # bounded by timeout_s (plus a poll period), not by Serve
    assert left == [True]
    assert "did not delete its apps" in caplog.text and "not done in 1 s" in caplog.text


def test_bench_server_turns_sigterm_into_ctrl_c_unless_the_program_took_it():
    """`bench serve --start-server` stops its server on SIGTERM (`timeout`, a CI cancel) as on Ctrl-C: Ray's
    driver handlers (Python's, then its core worker's, which aborts) give way to KeyboardInterrupt, so the
    bench's `finally` runs; a handler of the embedding program's own is left alone."""
    import signal
    import time

    from pagedserve.bench import local_server

    before = signal.getsignal(signal.SIGTERM)

    def ray_handler(signum, frame):  # stands for ray._private.worker's
        raise SystemExit(signum)

    ray_handler.__module__ = "ray._private.worker"
    try:
        signal.signal(signal.SIGTERM, ray_handler)
        local_server._stop_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
        events = []
        try:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(100):  # the handler runs in the main thread at its next check
                    time.sleep(0.01)
            finally:
                events.append("stopped")  # the bench's `finally: server.stop()`
        except KeyboardInterrupt:
            events.append("interrupted")
        assert events == ["stopped", "interrupted"]

        def own(signum, frame):
            pass

        signal.signal(signal.SIGTERM, own)
        local_server._stop_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)
