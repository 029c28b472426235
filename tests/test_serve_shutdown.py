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
