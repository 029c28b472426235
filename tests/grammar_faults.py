"""A grammar compile that fails, stalls or waits on purpose, for the structured-output tests.

It runs in the manager's compile worker processes (set as `manager.compile_fn`; it travels there by
name), so its signals are in the spec itself: a regex "boom" fails, "sleep:SECONDS" sleeps first,
"forever" never ends (only the time limit's kill stops it), "hold:PATH" waits until PATH exists, and
"alloc:BYTES" allocates that much first (to meet the worker's memory limit).
Any other spec compiles normally."""

from __future__ import annotations

import os
import time

from pagedserve.engine.structured_output.grammar import compile_spec


def faulty_compile(compiler, params):
    regex = params.regex or ""
    if regex == "boom":
        raise RuntimeError("injected compile failure")
    if regex == "forever":
        while True:
            time.sleep(1.0)
    if regex.startswith("sleep:"):
        time.sleep(float(regex.removeprefix("sleep:")))
    if regex.startswith("alloc:"):
        block = bytearray(int(regex.removeprefix("alloc:")))
        del block
    if regex.startswith("hold:"):
        path = regex.removeprefix("hold:")
        end = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.02)
    return compile_spec(compiler, params)
