"""Each `pagedserve bench` command and `pagedserve tune`, run through the CLI on a tiny random-weight
model with a tiny workload: the JSON report validates against the documented schema and its counts are
exact. Servers listen on 127.0.0.1 and are shut down by the command; no timing is asserted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from pagedserve.bench.report import REPORT_SCHEMA, validate_report
from pagedserve.bench.roofline import machine_figures
from pagedserve.cli import main
from tests.local_ray import fresh_local_ray
from tests.manifest_checks import build_serve_app, validate_serve_config


@pytest.fixture(scope="module")
def roofline_file(tmp_path_factory):
    """Machine figures from a tiny probe, so no command measures at full size."""
    path = tmp_path_factory.mktemp("roofline") / "roofline.json"
    machine_figures(path, bandwidth_bytes=1 << 20, matmul_side=32, repeats=1)
    return str(path)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama", max_position_embeddings=2048))


def _report(path) -> dict:
    import jsonschema

    report = json.loads(path.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    validate_report(report)
    return report


def _check_roofline(run: dict, phases: set[str]) -> None:
    assert set(run["roofline"]) == phases
    for r in run["roofline"].values():
        assert r["ideal_s"] > 0 and r["measured_s"] > 0 and r["percent_of_ideal"] > 0
        assert r["weight_bytes"] > 0 and r["flops"] > 0
        # The verdict rests on the figures beside it (issue 34: never a bound the measurements contradict).
        assert r["bandwidth_use"] == pytest.approx(r["t_memory"] / r["measured_s"])
        assert r["matmul_use"] == pytest.approx(r["t_compute"] / r["measured_s"])
        if r["verdict"] in ("memory-bound", "compute-bound"):
            use = r["bandwidth_use"] if r["verdict"] == "memory-bound" else r["matmul_use"]
            assert use >= 0.5 and use == max(r["bandwidth_use"], r["matmul_use"])
        else:
            assert max(r["bandwidth_use"], r["matmul_use"]) < 0.5
            host = r["host_share"]
            assert (r["verdict"] == "host-bound") == (host is not None and host >= 0.5), r


def test_bench_latency(model, roofline_file, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", model, "--input-len", "8", "--output-len", "4", "--batch-size", "3",
                 "--num-iters", "2", "--num-iters-warmup", "1", "--kv-cache-memory", "16MiB",
                 "--roofline-file", roofline_file, "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode_per_token" in printed and "roofline" in printed
    report = _report(out)
    assert report["command"] == "latency" and report["machine"]["memory_bandwidth_gb_s"] > 0
    (run,) = report["runs"]
    assert (run["num_requests"], run["prompt_tokens"], run["output_tokens"]) == (6, 6 * 8, 6 * 4)
    lat = run["latency_ms"]
    assert lat["e2e"]["count"] == lat["prefill"]["count"] == lat["decode_per_token"]["count"] == 2
    assert 0 < lat["prefill"]["mean"] < lat["e2e"]["mean"] and lat["decode_per_token"]["mean"] > 0
    _check_roofline(run, {"prefill", "decode"})
    assert run["roofline"]["prefill"]["tokens"] == 24 and run["roofline"]["decode"]["tokens"] == 3
    host = run["host_overhead"]  # the batch's 3 decode steps after its prefill, timed by the engine
    assert host["steps"] == 3 and 0 < host["model_ms"] <= host["step_ms"] and 0 <= host["host_share"] < 1
    assert run["roofline"]["decode"]["host_share"] == host["host_share"]
    assert 0 <= run["roofline"]["prefill"]["host_share"] < 1  # the batch's prefill steps, measured the same way
    assert "host overhead of a decode step at batch 3" in printed


def test_bench_throughput_against_hf(model, roofline_file, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", model, "--num-prompts", "5", "--input-len", "4:12", "--output-len", "2:6",
                 "--baseline", "hf", "--hf-batch-sizes", "2,4", "--hf-calibration-prompts", "2",
                 "--host-overhead-batch-sizes", "3,8,999",
                 "--kv-cache-memory", "16MiB", "--roofline-file", roofline_file, "--output-json", str(out)]) == 0
    report = _report(out)
    ours, hf = report["runs"]
    assert ours["params"]["engine"] == "pagedserve" and hf["params"]["engine"] == "hf"
    assert hf["params"]["batch_size"] in (2, 4)
    assert ours["completed"] == 5 and ours["failed"] == 0
    for key in ("num_requests", "prompt_tokens", "output_tokens"):  # the same workload, token for token
        assert ours[key] == hf[key]
    assert 5 * 2 <= ours["output_tokens"] <= 5 * 6 and 5 * 4 <= ours["prompt_tokens"] <= 5 * 12
    assert report["summary"]["ratio_output_tokens_per_s"] == pytest.approx(
        ours["throughput"]["output_tokens_per_s"] / hf["throughput"]["output_tokens_per_s"])
    _check_roofline(ours, {"run"})
    assert ours["host_overhead"]["steps"] > 0 and 0 <= ours["host_overhead"]["host_share"] < 1
    # The engine's own step count and host share (issue 34: not a model of full batches).
    assert ours["roofline"]["run"]["steps"] == ours["host_overhead"]["steps"]
    assert ours["roofline"]["run"]["host_share"] == ours["host_overhead"]["host_share"]
    _check_roofline(hf, {"run"})
    assert hf["roofline"]["run"]["host_share"] is None
    # 5 requests > 2 calibration prompts: both sizes measured on the sample, the faster ran them all.
    assert set(report["summary"]["hf_out_tok_s_by_batch_size"]) == {"2", "4"}
    assert report["summary"]["hf_swept_on"] == "the first 2 requests"
    # A decode step's host share at each asked batch size (999 > max_num_seqs: not measurable).
    decode = report["summary"]["decode_host_overhead"]
    assert set(decode) == {"3", "8", "999"} and decode["999"] is None
    for batch in ("3", "8"):
        assert decode[batch]["steps"] >= 15 and 0 <= decode[batch]["host_share"] < 1


def test_bench_throughput_dataset(model, tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "def fibonacci(n): return the n-th number please"},
                           {"from": "gpt", "value": "The quick brown fox jumps over the lazy dog."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short a prompt"}]},
    ]))
    out = tmp_path / "dataset.json"
    assert main(["bench", "throughput", model, "--dataset", str(data), "--num-prompts", "4", "--output-len", "5",
                 "--host-overhead-batch-sizes", "none",
                 "--kv-cache-memory", "16MiB", "--no-roofline", "--output-json", str(out)]) == 0
    report = _report(out)
    (run,) = report["runs"]
    assert run["num_requests"] == 1 and run["output_tokens"] == 5 and run["roofline"] == {}
    assert report["machine"] is None


def test_ctrl_c_during_a_bench_exits_130_with_one_line(model, roofline_file, tmp_path):
    """SIGINT while `pagedserve bench throughput` runs: the command stops, says so in one line (no
    traceback) and exits 130, as a shell reports a process stopped by SIGINT."""
    command = [sys.executable, "-m", "pagedserve.cli", "bench", "throughput", model, "--num-prompts", "4000",
               "--input-len", "16", "--output-len", "256", "--kv-cache-memory", "16MiB",
               "--host-overhead-batch-sizes", "none", "--roofline-file", roofline_file]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    stderr = ""
    try:
        deadline = time.monotonic() + 300
        while "Processed prompts" not in stderr:  # the progress bar: the requests are running
            assert process.poll() is None and time.monotonic() < deadline, stderr[-3000:]
            stderr += process.stderr.read(1)
        process.send_signal(signal.SIGINT)
        stderr += process.communicate(timeout=120)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr[-3000:]
    assert "pagedserve: interrupted" in stderr and "Traceback" not in stderr, stderr[-3000:]


def test_interrupted_command_reports_instead_of_raising(monkeypatch, capsys):
    from pagedserve.bench import cli as bench_cli

    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli, "run_bench_command", interrupted)
    assert main(["bench", "throughput", "--num-prompts", "1"]) == 130
    assert capsys.readouterr().err.strip() == "pagedserve: interrupted"


def test_bench_serve_start_server(model, roofline_file, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    with fresh_local_ray(num_cpus=4):
        rc = main(["bench", "serve", model, "--start-server", "--num-prompts", "4", "--input-len", "4:8",
                   "--output-len", "3:5", "--request-rate", "8,inf", "--max-concurrency", "4",
                   "--slo", "ttft:60s,tpot:60s", "--kv-cache-memory", "16MiB", "--timeout", "120",
                   "--roofline-file", roofline_file, "--output-json", str(out), "--plot", str(png),
                   "--offline-baseline"])
    assert rc == 0
    report = _report(out)
    assert [r["params"]["request_rate"] for r in report["runs"]] == [8.0, "inf"]
    # The offline engine ran the very workload the server got (same prompts, same exact output lengths).
    offline = report["summary"]["offline_baseline"]
    assert offline["num_requests"] == 4 and offline["output_tokens_per_s"] > 0
    for run in report["runs"]:
        assert (run["prompt_tokens"], run["output_tokens"]) == (offline["prompt_tokens"], offline["output_tokens"])
        assert run["served_to_offline"] == pytest.approx(
            run["throughput"]["output_tokens_per_s"] / offline["output_tokens_per_s"])
    for run in report["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0
        assert 4 * 3 <= run["output_tokens"] <= 4 * 5
        assert run["latency_ms"]["ttft"]["count"] == 4
        assert run["goodput"]["good_requests"] == 4 and run["goodput"]["attainment"] == 1.0
        _check_roofline(run, {"decode"})
        # The server's overhead split over the run (its /metrics before and after): every stage of the path
        # on Serve (the router's decision taken from the engine deployment's request router), both splits.
        split = run["overhead"]
        assert {"ingress", "router", "dispatch", "queue", "prefill", "decode", "output"} <= split["stage_ms"].keys()
        for key in ("ttft_ms", "tpot_ms"):
            assert 0 <= split[key]["framework_share"] <= 1
    assert report["summary"]["max_rate_meeting_slo"] == "inf"
    assert png.stat().st_size > 0


def test_offline_baseline_needs_the_one_engine_server_bench_serve_starts():
    import argparse

    from pagedserve.bench import serve_load

    parser = argparse.ArgumentParser()
    serve_load.add_parser(parser.add_subparsers(dest="bench_command"))
    serve_load.check_load_args(parser.parse_args(["serve", "--start-server", "--offline-baseline"]))
    with pytest.raises(ValueError, match="--offline-baseline: needs --start-server"):
        serve_load.check_load_args(parser.parse_args(["serve", "--offline-baseline"]))
    for extra in (["--pd"], ["--data-parallel-size", "2"], ["--workload", "shared-prefix"],
                  ["--compare-routing", "exact"]):
        with pytest.raises(ValueError, match="--offline-baseline: compares one engine"):
            serve_load.check_load_args(parser.parse_args(["serve", "--start-server", "--offline-baseline", *extra]))


def test_offline_baseline_runs_the_served_engine_settings_on_the_served_workload(monkeypatch, tmp_path):
    """The offline engine gets the server's engine settings (and, with --num-cpus-per-engine, the threads the
    served engine runs on those CPUs), never the serving ones, and the workload bench serve sends."""
    import argparse
    from types import SimpleNamespace

    from pagedserve.bench import serve_load, throughput
    from pagedserve.bench.offline_baseline import offline_baseline
    from pagedserve.engine import llm as llm_module

    made: list[dict] = []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            made.append(dict(kwargs, model=model))

        def get_tokenizer(self):
            return SimpleNamespace(encode=lambda text, add_special_tokens: [7, 3, 3, 5])

        def shutdown(self):
            pass

    def fake_timed_generate(llm, workload, use_tqdm=True):
        made[-1]["workload"] = workload
        outputs = [SimpleNamespace(error=None, outputs=[SimpleNamespace(token_ids=[1] * r.output_len)])
                   for r in workload]
        return None, outputs, 2.0

    monkeypatch.setattr(llm_module, "LLM", FakeLLM)
    monkeypatch.setattr(throughput, "timed_generate", fake_timed_generate)
    parser = argparse.ArgumentParser()
    serve_load.add_parser(parser.add_subparsers(dest="bench_command"))
    ns = parser.parse_args(["serve", "--start-server", "--offline-baseline", "--num-prompts", "3", "--input-len",
                            "4", "--output-len", "5", "--num-cpus-per-engine", "3", "--dtype", "float32",
                            "--stream-interval", "4", "--max-num-seqs", "8"])
    model = str(tmp_path)  # (the server's settings check that the model is a folder or a GGUF file)
    result = offline_baseline(model, serve_load.server_settings(ns),
                              lambda token_ids: serve_load.make_workload(ns, token_ids, model))
    (kwargs,) = made
    workload = kwargs.pop("workload")
    assert kwargs == {"model": model, "kv_cache_memory": ns.kv_cache_memory, "dtype": "float32",
                      "max_num_seqs": 8, "cpu_threads": 3}
    assert workload == serve_load.make_workload(ns, [3, 5, 7], model)  # the seed text's ids, sorted
    assert result == {"num_requests": 3, "prompt_tokens": 12, "output_tokens": 15, "duration_s": 2.0,
                      "output_tokens_per_s": 7.5}


def test_bench_serve_warms_the_server_up_before_the_timed_runs(monkeypatch, capsys):
    """--num-warmups requests go out (all at once) before the first rate and count nowhere: the workload's first
    ones at their own lengths with their prompts reversed (no prefix-cache hits for the timed requests); 0 sends
    none, a negative count is refused naming the flag, and a failed warm-up request is reported, not fatal."""
    import argparse
    import math

    from pagedserve.bench import loadgen, serve_load
    from pagedserve.bench.loadgen import LoadRun, RequestResult, ServerInfo
    from pagedserve.bench.workload import BenchRequest

    sent: list[tuple[str, list[BenchRequest], float]] = []

    def fake_run_load(url, model, workload, rate, max_concurrency, seed, headers, timeout, desc="requests"):
        sent.append((desc, list(workload), rate))
        ok = desc != "warm-up" or len(sent) > 1
        return LoadRun([RequestResult(ok=ok, prompt_tokens=len(r.prompt_token_ids), output_tokens=r.output_len,
                                      ttft=0.1, e2e=0.5, error="" if ok else "HTTP 503")
                        for r in workload], 1.0)

    monkeypatch.setattr(serve_load, "run_load", fake_run_load)
    monkeypatch.setattr(loadgen, "run_load", fake_run_load)
    monkeypatch.setattr(serve_load, "scrape", lambda *a, **k: None)
    parser = argparse.ArgumentParser()
    serve_load.add_parser(parser.add_subparsers(dest="bench_command"))
    info = ServerInfo("m", [1, 2, 3], 4096)
    workload = [BenchRequest([1, 2, 3], 4), BenchRequest([3, 3, 2, 1], 2), BenchRequest([2], 7)]

    ns = parser.parse_args(["serve", "--request-rate", "4,inf"])
    assert ns.num_warmups == 2
    runs = serve_load.sweep("http://x", info, workload, ns, None, None, None)
    assert [(d, rate) for d, _, rate in sent] == [("warm-up", math.inf), ("rate 4.0", 4.0), ("rate inf", math.inf)]
    assert sent[0][1] == [BenchRequest([3, 2, 1], 4), BenchRequest([1, 2, 3, 3], 2)]
    assert sent[1][1] == sent[2][1] == workload
    assert [r["num_requests"] for r in runs] == [3, 3]  # the warm-up counts nowhere
    assert "warm-up: 2 of 2 requests failed (first: HTTP 503)" in capsys.readouterr().err

    sent.clear()
    serve_load.sweep("http://x", info, workload, parser.parse_args(["serve", "--num-warmups", "9"]), None, None, None)
    assert len(sent[0][1]) == 3 and sent[0][0] == "warm-up"  # at most the whole workload
    sent.clear()
    serve_load.sweep("http://x", info, workload, parser.parse_args(["serve", "--num-warmups", "0"]), None, None, None)
    assert [d for d, _, _ in sent] == ["rate inf"]
    with pytest.raises(ValueError, match="--num-warmups: must be >= 0"):
        serve_load.check_load_args(parser.parse_args(["serve", "--num-warmups", "-1"]))


@pytest.mark.slow
def test_tune_two_by_two_writes_a_deployable_config(model, roofline_file, tmp_path):
    out, config_path, png = tmp_path / "tune.json", tmp_path / "tuned.yaml", tmp_path / "tune.png"
    with fresh_local_ray(num_cpus=4):
        rc = main(["tune", model, "--slo", "ttft:60s,tpot:60s", "--max-num-seqs", "1,4",
                   "--max-num-batched-tokens", "32,128", "--num-prompts", "4", "--input-len", "4:8",
                   "--output-len", "3:5", "--kv-cache-memory", "16MiB", "--timeout", "120",
                   "--roofline-file", roofline_file, "--output-json", str(out), "--output-config", str(config_path),
                   "--plot", str(png)])
    assert rc == 0
    report = _report(out)
    assert len(report["runs"]) == 4
    settings = {(r["params"]["max_num_seqs"], r["params"]["max_num_batched_tokens"]) for r in report["runs"]}
    assert settings == {(1, 32), (1, 128), (4, 32), (4, 128)}
    # the best is the one with the most goodput by the command's own measurements
    best = max(report["runs"], key=lambda r: (r["goodput"]["requests_per_s"],
                                              r["throughput"]["output_tokens_per_s"]))
    assert report["summary"]["best"]["params"] == best["params"]
    config = yaml.safe_load(config_path.read_text())
    validate_serve_config(config)
    (app,) = config["applications"]
    build_serve_app(app, model)  # the app builder accepts it
    assert app["args"]["max_num_seqs"] == best["params"]["max_num_seqs"]
    assert app["args"]["max_num_batched_tokens"] == best["params"]["max_num_batched_tokens"]
    assert png.stat().st_size > 0
