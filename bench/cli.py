"""The `bench` and `tune` subcommands of the `pagedserve` console script.

`add_bench_commands(subparsers)` registers them on the main parser; `run_bench_command(ns)` runs the
one parsed. Bad arguments print `pagedserve <command>: error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

BENCH_COMMANDS = ("bench", "tune")


def add_bench_commands(subparsers: argparse._SubParsersAction) -> None:
    from pagedserve.bench import latency, readme, serve_load, throughput, tune

    bench = subparsers.add_parser("bench", help="benchmark latency, offline throughput or a server under load",
                                  description="Benchmarks with a readable table, --output-json (one schema for "
                                              "all; docs/benchmarks.md) and the roofline beside every figure.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    latency.add_parser(sub)
    throughput.add_parser(sub)
    serve_load.add_parser(sub)
    readme.add_parser(sub)
    tune.add_parser(subparsers)


def run_bench_command(ns: argparse.Namespace) -> int:
    name = ns.command if ns.command == "tune" else f"bench {ns.bench_command}"
    try:
        return ns.bench_func(ns)
    except ValueError as exc:
        print(f"pagedserve {name}: error: {exc}", file=sys.stderr)
        return 2
