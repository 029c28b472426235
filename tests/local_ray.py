"""A fresh local Ray for a test module that starts its own (`ray.init(num_cpus=...)` on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def fresh_local_ray(num_cpus: int) -> Iterator[None]:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")  # only because the test starts its own local Ray
        # address="local": always a new cluster, never one a `ray start` left running on the machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()
