"""Offline throughput against HF `generate`: the same as `pagedserve bench throughput ARGS` (docs/benchmarks.md);
it prints the host-overhead share of the run beside the throughput.

    python benchmarks/throughput.py --random-weights small --baseline hf
"""

import sys

from pagedserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
