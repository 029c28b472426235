"""OpenMP's wait policy for the CPU kernels, chosen before torch loads its OpenMP runtime.

libgomp (torch's CPU thread pool) reads OMP_WAIT_POLICY once, when torch is imported. Its default lets an
idle pool thread spin for a while before it sleeps, so between two parallel regions (at batch 1 a decode step
is ~120 of them, with Python in between) every thread keeps its core busy. On a machine whose cores are
shared with other processes that is ruinous: the spinning threads compete with the thread doing the work and
with the other processes, and a region waits for a descheduled thread's whole time slice. Measured on a
2-core machine at a load average of 2-5: a batch-1 decode step on
two threads took 0.8-1.3 s with the default policy and 27-80 ms with PASSIVE (one thread: 28-77 ms), and
`bench throughput` ran at 16 output tok/s against 159-189. PASSIVE threads sleep as soon as they wait, at the
cost of a futex wake per region on an idle machine.

So PASSIVE is the default here, unless the user chose a policy (OMP_WAIT_POLICY) or a spin count
(GOMP_SPINCOUNT) themselves. Set in os.environ, it also reaches the processes started afterwards (Ray's
workers inherit the driver's environment).
"""

from __future__ import annotations

import os
import sys

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_passive_openmp_wait() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless a user setting of USER_SETTINGS is there. Returns whether this
    process's OpenMP runtime will read it (torch not imported yet); child processes read it either way."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "torch" not in sys.modules
