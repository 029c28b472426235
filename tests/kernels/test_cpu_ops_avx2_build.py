"""The compiled CPU ops built for an AVX2-only target pass the same kernel tests.

The ops are compiled with -march=native, so a CI machine with AVX-512 compiles and runs only the AVX-512
paths; the AVX2 ones (the GGUF GEMV and tile dequantization, the generic paged attention) would go
untested. Here the kernel test files run again in a subprocess with `PAGEDSERVE_CPU_MARCH=x86-64-v3`
(AVX2, FMA, F16C: no AVX-512), which builds those paths on any CPU able to run them. On a CPU without
AVX-512 the native build already is that build, and the main run has tested it: nothing to add.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# What gcc's x86-64-v3 may use, as /proc/cpuinfo names it (abm: LZCNT).
X86_64_V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64" or not X86_64_V3_FLAGS <= cpu_flags(),
                    reason="needs an x86-64 CPU that runs x86-64-v3 code")
@pytest.mark.skipif("avx512f" not in cpu_flags(),
                    reason="no AVX-512 here: the native build is the AVX2 one, tested by the main run")
def test_kernel_tests_pass_with_the_ops_built_for_x86_64_v3():
    env = dict(os.environ, PAGEDSERVE_CPU_MARCH="x86-64-v3")
    check = ("from pagedserve.kernels.cpu.build import compile_flags, cpu_ops_available, cpu_ops_error\n"
             "assert cpu_ops_available(), cpu_ops_error()\n"
             "print(compile_flags()[-1])\n")
    built = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0 and built.stdout.split()[-1] == "-march=x86-64-v3", built.stderr[-3000:]
    # Everything must run: the compiled-op tests skip when the ops did not build, which would pass here.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                          "-rs", str(HERE / "test_gguf_quant.py"), str(HERE / "test_cpu_ops.py")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, run.stdout[-3000:]
