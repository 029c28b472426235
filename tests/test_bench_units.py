"""Bench arithmetic on hand-made figures: SLO parsing and goodput, the roofline model, the report schema,
the README section rewrite and argument errors. No timing is asserted anywhere."""

from __future__ import annotations

import json
import math
import os

import pytest

from pagedserve.bench import hf_baseline, readme, roofline
from pagedserve.bench import report as rep
from pagedserve.bench.roofline import Machine, ModelFacts, machine_figures, probe, run_roofline, step_roofline
from pagedserve.bench.slo import RequestLatency, goodput, max_rate_meeting_slo, meets_slo, parse_slo
from pagedserve.bench.tune import pick_best
from pagedserve.bench.workload import BenchRequest
from pagedserve.cli import main

# ----------------------------------------------------------------------------- SLO and goodput


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft:500ms,tpot:50ms") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo("e2e:2s, itl=250us") == {"e2e": 2.0, "itl": 0.00025}
    assert parse_slo("TTFT:300") == {"ttft": 0.3}  # a bare number is milliseconds
    for bad, word in [("", "empty"), ("ttft", "cannot parse"), ("latency:5ms", "unknown metric"),
                      ("ttft:5ms,ttft:6ms", "twice"), ("ttft:0ms", "> 0"), ("ttft:5min", "cannot parse")]:
        with pytest.raises(ValueError, match=word):
            parse_slo(bad)


def test_goodput_on_hand_made_latencies():
    slo = {"ttft": 0.5, "tpot": 0.05}
    requests = [
        RequestLatency(ok=True, ttft=0.1, tpot=0.01, max_itl=0.02, e2e=1.0),   # good
        RequestLatency(ok=True, ttft=0.5, tpot=0.05, max_itl=0.3, e2e=2.0),    # good: at the limit counts
        RequestLatency(ok=True, ttft=0.6, tpot=0.01, max_itl=0.02, e2e=1.0),   # TTFT too slow
        RequestLatency(ok=True, ttft=0.1, tpot=0.051, max_itl=0.02, e2e=1.0),  # TPOT too slow
        RequestLatency(ok=True, ttft=0.2, tpot=None, max_itl=None, e2e=0.2),   # one token: no TPOT to miss
        RequestLatency(ok=False),                                              # failed: never good
    ]
    assert [meets_slo(r, slo) for r in requests] == [True, True, False, False, True, False]
    result = goodput(requests, slo, duration_s=2.0)
    assert result == {"requests_per_s": 1.5, "good_requests": 3, "attainment": 0.5}
    assert not meets_slo(RequestLatency(ok=True, ttft=0.1, max_itl=0.3), {"itl": 0.25})
    with pytest.raises(ValueError, match="duration_s"):
        goodput(requests, slo, 0.0)


def test_max_rate_meeting_slo_reads_the_sweep_from_the_bottom():
    runs = [(4.0, 0.95), (1.0, 1.0), (math.inf, 0.5), (8.0, 0.9)]
    assert max_rate_meeting_slo(runs, 0.9) == 8.0
    assert max_rate_meeting_slo(runs, 0.4) == math.inf
    assert max_rate_meeting_slo([(1.0, 0.5), (2.0, 1.0)], 0.9) is None  # the lowest misses: none
    assert max_rate_meeting_slo([(1.0, 1.0), (2.0, 0.5), (4.0, 1.0)], 0.9) == 1.0
    with pytest.raises(ValueError, match="slo-attainment"):
        max_rate_meeting_slo(runs, 0.0)


def _tune_run(name, goodput_rps, attainment, out_tps):
    return {"name": name, "goodput": {"requests_per_s": goodput_rps, "attainment": attainment},
            "throughput": {"output_tokens_per_s": out_tps}}


def test_tune_picks_the_most_goodput_inside_the_slo():
    runs = [_tune_run("a", 5.0, 0.8, 900.0), _tune_run("b", 3.0, 1.0, 300.0), _tune_run("c", 3.0, 0.95, 400.0),
            _tune_run("d", 2.0, 1.0, 800.0)]
    assert pick_best(runs, 0.9)["name"] == "c"  # a misses; b and c tie on goodput, c has more tokens/s
    assert pick_best(runs, 0.7)["name"] == "a"
    assert pick_best([_tune_run("x", 1.0, 0.1, 1.0)], 0.9) is None


# ----------------------------------------------------------------------------- roofline

FACTS = ModelFacts(num_layers=2, hidden_size=4, num_attention_heads=2, num_kv_heads=1, head_dim=2,
                   intermediate_size=8, vocab_size=10, tie_word_embeddings=False, dtype_bytes=4, dtype="float32")
MACHINE = Machine(memory_bandwidth=1000.0, matmul_flops={"float32": 10_000.0}, device="test", threads=1,
                  measured_at="now")


def test_model_facts_arithmetic():
    # per layer: q,o 4*2*2*2 = 32; k,v 4*1*2*2 = 16; mlp 3*4*8 = 96 -> 144; x2 layers + LM head 10*4
    assert FACTS.matmul_params == 2 * 144 + 40 == 328
    assert FACTS.weight_bytes == 328 * 4
    assert FACTS.kv_bytes_per_token == 2 * 2 * 1 * 2 * 4 == 32


def test_step_roofline_memory_bound_decode():
    r = step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=2.0)
    assert r.kv_bytes == 320 and r.weight_bytes == 1312
    assert r.t_memory == pytest.approx((1312 + 320) / 1000)
    assert r.flops == 2 * 328 * 2 + 4 * 2 * 2 * 2 * 10
    assert r.t_compute == pytest.approx(r.flops / 10_000)
    assert r.ideal_s == r.t_memory and r.verdict == "memory-bound"
    assert r.percent_of_ideal == pytest.approx(100 * r.ideal_s / 2.0)


def test_step_roofline_compute_bound_prefill():
    r = step_roofline(FACTS, MACHINE, tokens=512, context_tokens=512, measured_s=40.0,
                      attention_pairs=512 * 513 // 2)
    assert r.t_compute > r.t_memory and r.matmul_use > 1 and r.verdict == "compute-bound"
    per_step = step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=20.0, steps=10)
    assert per_step.measured_s == pytest.approx(2.0) and per_step.verdict == "memory-bound"
    with pytest.raises(ValueError):
        step_roofline(FACTS, MACHINE, tokens=0, context_tokens=1, measured_s=1.0)
    with pytest.raises(ValueError):
        step_roofline(FACTS, MACHINE, tokens=1, context_tokens=1, measured_s=0.0)
    with pytest.raises(ValueError, match="host_share"):
        step_roofline(FACTS, MACHINE, tokens=1, context_tokens=1, measured_s=1.0, host_share=1.5)


def test_verdict_names_only_a_measured_bound():
    """Issue 34: a decode step at 22.5% of its (memory) ideal whose measured host share is 1% was called
    host-bound. Far from both roofs, the host's measured share decides; without one the gap is unexplained."""
    ideal = step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=1.0).ideal_s
    slow = ideal / 0.225
    low_host = step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=slow, host_share=0.01)
    assert low_host.percent_of_ideal == pytest.approx(22.5)
    assert low_host.bandwidth_use == pytest.approx(0.225) and low_host.host_share == 0.01
    assert low_host.verdict == "unexplained"
    assert step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=slow).verdict == "unexplained"
    busy_host = step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=slow, host_share=0.7)
    assert busy_host.verdict == "host-bound"
    # Half of the bandwidth reached: the roof names the bound, whatever the host's share.
    near_roof = step_roofline(FACTS, MACHINE, tokens=2, context_tokens=10, measured_s=ideal / 0.6, host_share=0.7)
    assert near_roof.bandwidth_use == pytest.approx(0.6) and near_roof.verdict == "memory-bound"
    assert roofline.verdict(0.1, 0.55, None) == "compute-bound"
    assert roofline.verdict(0.49, 0.3, 0.49) == "unexplained"
    assert set(roofline.VERDICTS) == set(rep.REPORT_SCHEMA["properties"]["runs"]["items"]["properties"]["roofline"][
        "additionalProperties"]["properties"]["verdict"]["enum"])


def test_run_roofline_takes_the_measured_step_count():
    r = run_roofline(FACTS, MACHINE, [(4, 3), (2, 1)], steps=2, measured_s=4.0)
    assert r.steps == 2
    assert r.tokens == 5  # 10 tokens over 2 steps
    # context: prompts 6 + decode 3*(4+1) + 1*(2+0) = 23 -> 11.5 a step
    assert r.context_tokens == round(23 / 2)
    assert r.measured_s == pytest.approx(2.0)
    # Issue 34: the engine ran 240 steps where a model of full batches says 119; the measured count is used.
    engine = run_roofline(FACTS, MACHINE, [(300, 100)] * 256, steps=240, measured_s=30.5, host_share=0.2)
    assert engine.steps == 240 and engine.measured_s == pytest.approx(30.5 / 240) and engine.host_share == 0.2
    with pytest.raises(ValueError, match="steps"):
        run_roofline(FACTS, MACHINE, [(4, 3)], steps=0, measured_s=1.0)


def test_probe_smoke_and_cache(tmp_path, monkeypatch):
    from pagedserve.bench import roofline

    machine = probe(bandwidth_bytes=1 << 20, matmul_side=32, dtypes=("float32",), repeats=1)
    assert machine.memory_bandwidth > 0 and machine.matmul_flops["float32"] > 0
    path = tmp_path / "roofline.json"
    first = machine_figures(path, bandwidth_bytes=1 << 20, matmul_side=32, dtypes=("float32",), repeats=1)
    with monkeypatch.context() as mp:
        mp.setattr(roofline, "probe", lambda **_: pytest.fail("probed again despite the cache"))
        again = machine_figures(path)  # cached: the same figures come back, no probe runs
    assert again.measured_at == first.measured_at
    assert again.memory_bandwidth == pytest.approx(first.memory_bandwidth)
    assert again.matmul_flops == pytest.approx(first.matmul_flops)
    assert json.loads(path.read_text())
    path.write_text("not json")
    assert machine_figures(path, bandwidth_bytes=1 << 20, matmul_side=32, dtypes=("float32",),
                           repeats=1).memory_bandwidth > 0


def test_cached_figures_are_keyed_by_the_settings_that_change_the_probe(tmp_path, monkeypatch):
    """Figures probed with oneDNN held to an older ISA are not reused without the cap, nor the other way."""
    real_probe, probes = roofline.probe, []

    def counted(**kwargs):
        probes.append(os.environ.get("ONEDNN_MAX_CPU_ISA"))
        return real_probe(bandwidth_bytes=1 << 20, matmul_side=32, dtypes=("float32",), repeats=1)

    monkeypatch.setattr(roofline, "probe", counted)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    path = tmp_path / "roofline.json"
    machine_figures(path)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    machine_figures(path)
    machine_figures(path)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    machine_figures(path)
    assert probes == [None, "AVX2"]
    assert len(json.loads(path.read_text())) == 2


# ----------------------------------------------------------------------------- the HF baseline's sweep


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeHF:
    """HF `generate` on a fake clock: a forward pass over b rows costs 1 + b^2 seconds (so batch 1 is the
    fastest per token), and the first call costs `cold_s` more (the set-up a first call pays)."""

    def __init__(self, clock: FakeClock, cold_s: float = 0.0) -> None:
        self.clock, self.cold_s, self.calls = clock, cold_s, []

    def generate(self, ids, max_new_tokens, **_):
        rows = ids.shape[0]
        self.clock.now += (self.cold_s if not self.calls else 0.0) + max_new_tokens * (1 + rows * rows)
        self.calls.append((rows, max_new_tokens))


def _fake_hf(monkeypatch, cold_s: float = 100.0) -> FakeHF:
    clock = FakeClock()
    model = FakeHF(clock, cold_s)
    monkeypatch.setattr(hf_baseline, "load_hf_model", lambda path, dtype: model)
    monkeypatch.setattr(hf_baseline, "time", type("FakeTime", (), {"perf_counter": staticmethod(clock)}))
    return model


def test_hf_baseline_sweeps_the_whole_workload_after_a_warm_up(monkeypatch):
    """Issue 34: the HF figure must be HF at its best batch size. The first call's set-up lands on the
    warm-up, not on the first size measured (which is the fastest here), and a workload no larger than the
    calibration sample is run whole at every size, the fastest run being the baseline."""
    model = _fake_hf(monkeypatch)
    workload = [BenchRequest([5, 6, 7], 4) for _ in range(8)]
    result = hf_baseline.hf_baseline("m", None, workload, [4, 2, 1, 64], sample=32)
    assert model.calls[0] == (1, 2)  # the warm-up: one request, two new tokens
    assert sorted(result.rates) == [1, 2, 4, 8]  # 64 over 8 requests is one batch of 8
    assert result.swept_whole_workload and result.batch_size == 1
    assert result.seconds == pytest.approx(8 * 4 * 2)  # 8 batches of 1 row, 4 passes of 2 s each
    assert result.rates[1] == pytest.approx(32 / result.seconds) and result.rates[8] < result.rates[2] < result.rates[1]
    assert len(model.calls) == 1 + 8 + 4 + 2 + 1  # the warm-up, then each size once: nothing runs twice
    assert result.steps == 8 * 4


def test_hf_baseline_calibrates_a_large_workload_on_a_sample(monkeypatch):
    model = _fake_hf(monkeypatch)
    workload = [BenchRequest([5, 6, 7], 4) for _ in range(12)]
    result = hf_baseline.hf_baseline("m", None, workload, [1, 2, 4], sample=4)
    assert not result.swept_whole_workload and result.batch_size == 1
    assert len(model.calls) == 1 + (4 + 2 + 1) + 12  # warm-up, the 4-request sample at each size, the whole run
    assert result.seconds == pytest.approx(12 * 4 * 2)


def test_hf_forward_passes_and_batch_sizes():
    workload = [BenchRequest([1], n) for n in (3, 5, 2, 7, 1)]
    assert hf_baseline.forward_passes(workload, 2) == 5 + 7 + 1
    assert hf_baseline.forward_passes(workload, 8) == 7
    assert hf_baseline.batch_sizes_to_measure([64, 2, 8, 2], 5) == [2, 5]


# ----------------------------------------------------------------------------- report schema and README


def _run(**overrides):
    run = {"name": "r", "params": {}, "num_requests": 2, "completed": 2, "failed": 0, "prompt_tokens": 8,
           "output_tokens": 4, "duration_s": 1.0, "throughput": rep.throughput(2, 8, 4, 1.0),
           "latency_ms": {"e2e": rep.summarize([0.1, 0.3])},
           "roofline": {"decode": step_roofline(FACTS, MACHINE, 2, 10, 2.0).to_dict()}}
    return {**run, **overrides}


def test_summary_and_schema():
    s = rep.summarize([0.001, 0.002, 0.003])
    assert s["count"] == 3 and s["mean"] == pytest.approx(2.0) and s["min"] <= s["p50"] <= s["p99"] <= s["max"]
    assert rep.summarize([]) is None
    report = rep.make_report("serve", "m", {"request_rate": [math.inf]}, [_run()], MACHINE.to_dict())
    rep.validate_report(report)
    assert report["config"]["request_rate"] == ["inf"]
    broken = json.loads(json.dumps(report))
    broken["runs"][0]["latency_ms"]["e2e"]["p50"] = 1e9  # above p99
    with pytest.raises(ValueError, match="percentiles"):
        rep.validate_report(broken)
    broken = json.loads(json.dumps(report))
    del broken["runs"][0]["throughput"]
    with pytest.raises(ValueError, match="throughput"):
        rep.validate_report(broken)
    with pytest.raises(ValueError, match="command"):
        rep.make_report("nope", "m", {}, [_run()], None)


def test_readme_section_regeneration_is_idempotent(tmp_path):
    report_path = tmp_path / "serve.json"
    rep.write_report(rep.make_report("serve", "/models/m", {"num_prompts": 2}, [_run()], MACHINE.to_dict()),
                     report_path)
    doc = tmp_path / "README.md"
    doc.write_text(f"# Title\n\n## Performance\n\n{readme.BEGIN}\nold text\n{readme.END}\n\n## Next\n")
    assert main(["bench", "report", str(report_path), "--readme", str(doc)]) == 0
    once = doc.read_text()
    assert "old text" not in once and "| r | 2/2 |" in once and once.endswith("## Next\n")
    assert main(["bench", "report", str(report_path), "--readme", str(doc)]) == 0
    assert doc.read_text() == once
    doc.write_text("# no markers\n")
    assert main(["bench", "report", str(report_path), "--readme", str(doc)]) == 2


def test_bad_arguments_are_clear_errors(capsys, tmp_path):
    assert main(["bench", "latency", str(tmp_path / "missing"), "--no-roofline"]) == 2
    assert "MODEL" in capsys.readouterr().err
    assert main(["bench", "latency", "--batch-size", "0", "--no-roofline"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    assert main(["bench", "serve", "--slo", "ttft:fast", "--no-roofline"]) == 2
    assert "--slo" in capsys.readouterr().err
    assert main(["bench", "serve", "--pd", "--no-roofline"]) == 2  # --pd describes the server it starts
    assert "--start-server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--request-rate", "-1"])
    with pytest.raises(SystemExit):
        main(["tune", "--slo", "ttft:1s", "--max-num-seqs", "0"])


def test_readme_performance_section_matches_the_committed_reports():
    """The README's generated section is what `make bench-readme` writes from benchmarks/reports/."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    reports = sorted((root / "benchmarks" / "reports").glob("*.json"))
    assert reports, "benchmarks/reports/ holds the reports the README is generated from"
    text = (root / "README.md").read_text()
    section = readme.render([rep.load_report(p) for p in reports])
    assert readme.rewrite_section(text, section) == text, "README out of date: run `make bench-readme`"


def test_readme_section_states_the_llama_cpp_ratios_of_the_reports_that_ran_it():
    from pathlib import Path

    reports = Path(__file__).resolve().parent.parent / "benchmarks" / "reports"
    latency = rep.load_report(reports / "latency-default-model.json")
    throughput = rep.load_report(reports / "throughput-default-model.json")
    section = readme.render([latency, throughput])
    decode = latency["summary"]["llama_cpp_over_pagedserve_median_time"]["decode_per_token"]
    assert f"decode_per_token **{decode:.2f}x**" in section
    versus = throughput["summary"]["ratio_vs_llama_cpp_output_tokens_per_s"]
    assert "pagedserve / llama.cpp (its fastest GGUF type and batch size; batch 8:" in section and f"**{versus:.2f}x**" in section
    del latency["summary"]["llama_cpp_over_pagedserve_median_time"], throughput["summary"]["ratio_vs_llama_cpp_output_tokens_per_s"]
    assert "llama.cpp time" not in readme.render([latency]) and "pagedserve / llama.cpp" not in readme.render([throughput])


def test_a_report_states_the_cpu_and_the_llama_cpp_types_it_compared():
    report = rep.make_report("throughput", "/models/m.gguf", {}, [_run(name="pagedserve")], MACHINE.to_dict(),
                             {"ratio_vs_llama_cpp_output_tokens_per_s": 2.5,
                              "llama_cpp_out_tok_s_by_batch_size": {"8": 40.0},
                              "llama_cpp_out_tok_s_by_type": {"Q4_1": {"8": 30.0}, "BF16": {"8": 40.0}}})
    env = report["environment"]
    assert env["cpu_capability"] and env["cpu_bf16"].split(" ")[0] in {"native", "emulated"}
    env.update(cpu_model="Some CPU", cpu_capability="AVX512", cpu_bf16="native (AVX-512 BF16)")
    section = readme.render([report])
    assert "(Some CPU, ISA AVX512, bf16 native (AVX-512 BF16))" in section
    assert "its fastest GGUF type and batch size; Q4_1: batch 8: 30.0; BF16: batch 8: 40.0 out tok/s" in section
    assert "**2.50x**" in section
