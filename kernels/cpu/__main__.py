"""python -m pagedserve.kernels.cpu: build the compiled CPU ops ahead of time and say where they are."""

import logging
import time

from pagedserve.kernels.cpu.build import build_directory, cpu_ops_error, load_cpu_ops

logging.basicConfig(level=logging.INFO)
start = time.perf_counter()
ok = load_cpu_ops()
print(f"pagedserve CPU ops: {'ready' if ok else 'NOT built: ' + str(cpu_ops_error())} "
      f"({build_directory()}, {time.perf_counter() - start:.1f} s)")
raise SystemExit(0 if ok else 1)
