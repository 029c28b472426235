"""The `pagedserve` console script: the serving commands (cluster/cli.py) and the benchmark ones
(bench/cli.py) on one parser.

It lives above both layers because bench/ imports cluster/ and never the other way. The bench
modules are imported only when the command line may need them (bench/cli.py itself imports nothing
but argparse until `add_bench_commands` runs), so `serve` and `generate` never load the bench client.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    from pagedserve.bench.cli import BENCH_COMMANDS, add_bench_commands, run_bench_command
    from pagedserve.cluster import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if cli.command_word(argv) in cli.CORE_COMMANDS:
            return cli.main(argv)
        ns = cli.build_parser(add_commands=add_bench_commands).parse_args(argv)
        if ns.command in BENCH_COMMANDS:
            return run_bench_command(ns)
        return cli.run(ns)
    except KeyboardInterrupt:
        # Ctrl-C (or SIGTERM, which `bench serve --start-server` takes as Ctrl-C) while a command ran: its
        # `finally` blocks have stopped what it started. One line instead of a traceback, and the status a
        # shell gives a process stopped by SIGINT.
        print("pagedserve: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
