"""`pagedserve bench serve --workload shared-prefix --compare-routing` end to end on a tiny model: one app per
arm on one Ray, each arm's policy reaching the engine deployment's request router, the report valid. Servers
listen on 127.0.0.1 and are shut down by the command; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from pagedserve.bench.report import validate_report
from pagedserve.cli import main
from tests.local_ray import fresh_local_ray

APPROX_KINDS = {"single", "prefix_affine", "prefix_fallback", "balanced"}
EXACT_KINDS = {"single", "exact_hit", "offload_hit", "miss", "stale_fallback"}


@pytest.mark.slow  # two app starts: minutes on two CPU cores
def test_compare_routing_runs_each_policy_on_its_own_app(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama", max_position_embeddings=2048))
    out = tmp_path / "compare.json"
    with fresh_local_ray(num_cpus=4):
        rc = main(["bench", "serve", model, "--start-server", "--workload", "shared-prefix", "--tenants", "4",
                   "--context-len", "16", "--questions", "2", "--question-len", "4", "--output-len", "3",
                   "--block-size", "4", "--kv-demand-ratio", "2", "--max-concurrency", "1", "--timeout", "120",
                   "--compare-routing", "prefix_approx,exact+offload", "--kv-offload-size", "4MiB",
                   "--num-cpus-per-engine", "1", "--no-roofline", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    validate_report(report)
    assert [run["policy"] for run in report["runs"]] == ["prefix_approx", "exact+offload"]
    assert report["summary"]["engine_kv_blocks"] == 8  # 4 tenants x 4 context blocks / 2
    for run in report["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0
        cache = run["cache"]
        assert cache["queried_tokens"] > 0 and 0 <= cache["prefix_hit_rate"] <= 1
        assert sum(cache["routing_decisions"].values()) >= 8  # the warm-up's requests are routed too
    approx, exact = (run["cache"]["routing_decisions"] for run in report["runs"])
    assert set(approx) <= APPROX_KINDS and set(exact) <= EXACT_KINDS and exact.keys() - {"single"}
    assert sum(report["runs"][1]["cache"]["predictions"].values()) >= 8  # exact routing checked its predictions
    assert set(report["summary"]["policies"]) == {"prefix_approx", "exact+offload"}
