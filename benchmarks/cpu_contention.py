"""What a busy neighbour on its cores costs the engine: offline throughput alone vs beside a bursty process.

    python benchmarks/cpu_contention.py [--busy-ms 0.5] [--idle-ms 1.5] [--rounds 3] [--model PATH] [--json F]

A served engine shares its cores with the ingress, Serve's proxy and controller, Ray's daemons and, in a
benchmark, the load generator: short bursts of work, thousands of times a second. This reproduces that
without a server. A child process alternates spinning for `--busy-ms` and sleeping for `--idle-ms`; the
engine runs one workload alone and beside it, interleaved over `--rounds` in one process (same engine,
same workload, warm). Printed per round and as medians: output tokens/s alone and beside the neighbour,
the neighbour's share of the machine's CPU time (measured: its own CPU-seconds over the run, divided by
the run's wall time and the CPUs this process may use), and the engine's cost per neighbour CPU-second:
the throughput lost divided by that share. 1.0 is plain sharing (the neighbour's CPU-second costs the
engine one); the engine's threads wait for each other at the end of every parallel region, so a thread
that loses its core for a moment holds up the others and the figure is above 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

from pagedserve.bench.throughput import timed_generate
from pagedserve.bench.workload import BenchRequest, parse_range, synthetic, vocab_token_ids

# The neighbour: spins for `busy` seconds, sleeps for `idle`, until SIGTERM; then prints its CPU seconds.
NEIGHBOUR = """
import os, signal, sys, time
busy, idle, policy = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if policy == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
elif policy.startswith("nice"):
    os.nice(int(policy[4:]))
def stop(*_):
    print(time.process_time(), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
# What it runs at, as the kernel has it (so a priority asked for is one applied).
print("ready", time.process_time(), os.getpriority(os.PRIO_PROCESS, 0),
      int(os.sched_getscheduler(0) == os.SCHED_IDLE), flush=True)
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


@dataclasses.dataclass
class NeighbourRun:
    """One run beside the neighbour: the engine's output tokens/s, the neighbour's share of the machine's
    CPU time, and the scheduling the neighbour ran at (its nice value; SCHED_IDLE or not)."""

    tok_s: float
    share: float
    nice: int
    sched_idle: bool


@dataclasses.dataclass
class Round:
    alone_tok_s: float
    beside_tok_s: float
    neighbour_share: float  # of the machine's CPU time over the run beside it
    neighbour_nice: int  # the scheduling the neighbour ran at, as the kernel had it
    neighbour_sched_idle: bool

    @property
    def loss(self) -> float:
        return 1.0 - self.beside_tok_s / self.alone_tok_s

    @property
    def cost_per_cpu_second(self) -> float:
        return self.loss / self.neighbour_share if self.neighbour_share > 0 else float("nan")


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_beside_neighbour(llm, workload: list[BenchRequest], busy_ms: float, idle_ms: float,
                         policy: str) -> NeighbourRun:
    """One timed run beside the neighbour (`policy`: "normal", "idle" for SCHED_IDLE, or "niceN")."""
    child = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(busy_ms / 1e3), str(idle_ms / 1e3), policy],
                             stdout=subprocess.PIPE, text=True)
    try:
        ready = child.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("the neighbour process did not start")
        cpu_at_start = float(ready[1])  # (its interpreter's start-up is not part of the run)
        nice, sched_idle = int(ready[2]), ready[3] == "1"
        started = time.perf_counter()
        _, outputs, seconds = timed_generate(llm, workload, use_tqdm=False)
        elapsed = time.perf_counter() - started
    finally:
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    # Over the whole call (the warm-up's few milliseconds included, on both sides of the ratio).
    share = (float(out.strip().splitlines()[-1]) - cpu_at_start) / elapsed / usable_cpus()
    return NeighbourRun(output_tokens(outputs) / seconds, share, nice, sched_idle)


def output_tokens(outputs) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the bundled default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(32, 256))
    p.add_argument("--output-len", type=parse_range, default=(32, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--busy-ms", type=float, default=0.5, help="the neighbour's burst of work (default 0.5 ms)")
    p.add_argument("--idle-ms", type=float, default=1.5, help="its sleep between bursts (default 1.5 ms)")
    p.add_argument("--neighbour-priority", default="normal",
                   help="the neighbour's scheduling: normal (default), idle (SCHED_IDLE: runs only on a core "
                        "the engine leaves), or niceN (e.g. nice19)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rounds and medians to this file")
    ns = p.parse_args(argv)
    if ns.busy_ms <= 0 or ns.idle_ms < 0:
        p.error("--busy-ms must be > 0 and --idle-ms >= 0")
    if ns.rounds < 1:
        p.error("--rounds must be >= 1")
    if ns.neighbour_priority not in ("normal", "idle") and not re.fullmatch(r"nice(1[0-9]|[0-9])", ns.neighbour_priority):
        p.error("--neighbour-priority must be normal, idle or niceN (N 0-19)")

    import torch

    from pagedserve.engine.llm import LLM
    from pagedserve.engine.models.default_model import resolve_default_model

    llm = LLM(model=ns.model or resolve_default_model(), dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory)
    ids = vocab_token_ids(llm.get_tokenizer(), llm.llm_engine.config.hf_config.vocab_size)
    workload = synthetic(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, ids)
    print(f"engine: {torch.get_num_threads()} threads on {usable_cpus()} CPUs "
          f"(torch CPU capability {torch.backends.cpu.get_cpu_capability()}); neighbour: {ns.busy_ms} ms busy, "
          f"{ns.idle_ms} ms idle, priority {ns.neighbour_priority}; {ns.num_prompts} requests, input {ns.input_len}, output {ns.output_len}")
    rounds = []
    for i in range(ns.rounds):
        _, outputs, seconds = timed_generate(llm, workload, use_tqdm=False)
        alone = output_tokens(outputs) / seconds
        run = run_beside_neighbour(llm, workload, ns.busy_ms, ns.idle_ms, ns.neighbour_priority)
        r = Round(alone, run.tok_s, run.share, run.nice, run.sched_idle)
        rounds.append(r)
        print(f"round {i + 1}: alone {alone:.1f} out tok/s, beside {r.beside_tok_s:.1f} "
              f"({r.beside_tok_s / alone:.2f}x); neighbour {r.neighbour_share:.1%} of the machine at nice "
              f"{r.neighbour_nice}{' SCHED_IDLE' if r.neighbour_sched_idle else ''}; cost per neighbour CPU-second "
              f"{r.cost_per_cpu_second:.2f}")
    med = statistics.median
    summary = {"alone_tok_s": med(r.alone_tok_s for r in rounds), "beside_tok_s": med(r.beside_tok_s for r in rounds),
               "neighbour_share": med(r.neighbour_share for r in rounds),
               "cost_per_cpu_second": med(r.cost_per_cpu_second for r in rounds)}
    print(f"median: alone {summary['alone_tok_s']:.1f}, beside {summary['beside_tok_s']:.1f} out tok/s; neighbour "
          f"{summary['neighbour_share']:.1%} of the machine; cost per neighbour CPU-second "
          f"{summary['cost_per_cpu_second']:.2f} (1.0: plain sharing)")
    if ns.json:
        report = {"engine_threads": torch.get_num_threads(), "cpus": usable_cpus(),
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "neighbour": {"busy_ms": ns.busy_ms, "idle_ms": ns.idle_ms, "priority": ns.neighbour_priority},
                  "rounds": [dataclasses.asdict(r) for r in rounds], "median": summary}
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
