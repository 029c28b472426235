"""The compiled CPU ops' sources compile for every x86-64 target they have code paths for.

The ops build with -march=native, so one machine compiles only its own paths: an AVX2-only CI machine
never instantiates the AVX-512 (or AVX-512 BF16 / AMX) loops, and a mistake there shows up only on a user's
newer CPU, where the build fails and every op falls back to the slow torch twins. Here each source is
compiled, not linked or run, with `-fsyntax-only` (templates are instantiated, so a name missing from one
target's path fails) for each target, whatever CPU this is.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from pagedserve.kernels.cpu.build import CFLAGS, SOURCES

# AVX2 + FMA + F16C; AVX-512 without BF16; AVX-512 BF16 without AMX (as on AMD Zen 4); AVX-512 BF16 with AMX.
TARGETS = ("x86-64-v3", "x86-64-v4", "cooperlake", "sapphirerapids")
COMPILER = shutil.which("c++")


@pytest.mark.skipif(platform.machine() != "x86_64" or COMPILER is None, reason="needs an x86-64 machine with c++")
@pytest.mark.parametrize("march", TARGETS)
def test_the_sources_compile_for_the_target(march):
    includes = [f"-isystem{path}" for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    flags = ["-fsyntax-only", "-DTORCH_EXTENSION_NAME=pagedserve_cpu_ops", *CFLAGS, f"-march={march}", *includes]
    jobs = [(source.name, subprocess.Popen([COMPILER, *flags, str(source)], stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)) for source in SOURCES]
    failures = {}
    for name, job in jobs:
        output, _ = job.communicate(timeout=600)
        if job.returncode != 0:
            failures[name] = output[-3000:]
    assert not failures, failures
