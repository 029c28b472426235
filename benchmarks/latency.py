"""`vllm bench latency`-shaped script: the same as `pagedserve bench latency ARGS` (see docs/benchmarks.md).

    python benchmarks/latency.py --random-weights small --input-len 32 --output-len 128 --batch-size 64
"""

import sys

from pagedserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "latency", *sys.argv[1:]]))
