"""benchmarks/cpu_contention.py on a tiny model: each round runs the workload alone and beside the neighbour
process, whose CPU share is measured (not assumed). No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_contention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_contention_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_rounds_report_throughput_alone_and_beside_a_measured_neighbour(bench, tiny_llama, tmp_path):
    out = tmp_path / "contention.json"
    assert bench.main(["--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                       "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:8", "--rounds", "2",
                       "--busy-ms", "2", "--idle-ms", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["alone_tok_s"] > 0 and r["beside_tok_s"] > 0
        assert 0 < r["neighbour_share"] <= 1  # it ran (half its time spinning), measured from its own CPU time
        # The scheduling it really ran at (an unchanged neighbour inherits this process's nice).
        assert (r["neighbour_nice"], r["neighbour_sched_idle"]) == (os.getpriority(os.PRIO_PROCESS, 0), False)
    assert report["neighbour"] == {"busy_ms": 2.0, "idle_ms": 2.0, "priority": "normal"}


def test_the_neighbour_runs_at_the_priority_asked_and_is_measured(bench, tiny_llama):
    from pagedserve.engine.llm import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    workload = [bench.BenchRequest(list(range(3 + i, 11 + i)), 16) for i in range(4)]  # long enough to be scheduled
    niced = bench.run_beside_neighbour(llm, workload, 1.0, 1.0, "nice19")
    assert niced.tok_s > 0 and 0 < niced.share <= 1
    assert (niced.nice, niced.sched_idle) == (19, False)
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)  # what an unchanged neighbour inherits
    idle = bench.run_beside_neighbour(llm, workload, 1.0, 1.0, "idle")
    assert idle.sched_idle and idle.nice == own_nice
    normal = bench.run_beside_neighbour(llm, workload, 1.0, 1.0, "normal")
    assert (normal.nice, normal.sched_idle) == (own_nice, False)


@pytest.mark.parametrize("args", [["--neighbour-priority", "realtime"], ["--neighbour-priority", "nice25"],
                                  ["--busy-ms", "0"], ["--rounds", "0"]])
def test_bad_settings_are_refused_before_anything_runs(bench, args, capsys):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert args[0] in capsys.readouterr().err
