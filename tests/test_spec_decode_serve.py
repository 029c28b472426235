"""Speculative decoding behind the OpenAI server: `--speculative-config` reaches every engine (DP and the PD
decode pool), greedy answers (streamed or not) equal the plain engine's, /metrics carries vLLM's
spec_decode_* counters summed over the engines (monotonic across engine restarts), and bad values fail
with the field named."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from pagedserve.cli import main
from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.fleet_stats import FleetStats
from pagedserve.cluster.serve.coordinator import DPCoordinator, EngineState
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serve.client import ServeEngineClient
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.tokenizer import load_tokenizer
from pydantic import ValidationError
from starlette.testclient import TestClient

from tests.local_serving import LocalHandle
from tests.tiny_models import VOCAB_SIZE

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "block_size": 4}
MAX_TOKENS = 20


def metric(text: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples whose labels contain `labels` (all label sets when empty)."""
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(v) for lab, v in pattern.findall(text) if labels in lab)


def repetitive_prompts(n: int, seed: int = 7) -> list[list[int]]:
    """Prompts that repeat a random segment: prompt lookup finds n-grams to propose."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segment = [rng.randrange(8, VOCAB_SIZE) for _ in range(4 + i)]
        out.append(segment * 4)
    return out


class TwoEngineServer:
    """The OpenAI app over two local engines (data parallel 2) behind the real DPCoordinator."""

    def __init__(self, model: str, speculative_config: dict | None) -> None:
        kwargs = {"model": model, **ENGINE, "speculative_config": speculative_config}
        self.actors = [EngineHost(kwargs, i, max_pending_requests=64) for i in range(2)]
        self.coordinator = DPCoordinator([LocalHandle(a) for a in self.actors], block_size=4, stats_interval_s=0.05)
        self.coordinator.start()
        args = ServeArgs(model=model, served_model_name="tiny", api_key=None)
        serving = OpenAIServing(self.coordinator, load_tokenizer(model), args, self.actors[0].engine.config.max_model_len)
        self.client = TestClient(build_fastapi_app(serving), raise_server_exceptions=False)

    def close(self) -> None:
        for actor in self.actors:
            actor.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def expected(model) -> dict[tuple[int, ...], str]:
    """The plain engine's greedy text per prompt."""
    llm = LLM(model=model, **ENGINE)
    prompts = repetitive_prompts(4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return {tuple(p): o.outputs[0].text for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def server(model):
    srv = TwoEngineServer(model, NGRAM)
    try:
        with srv.client:  # one event loop for the module: the coordinator's stats poller keeps running
            yield srv
    finally:
        srv.close()


def _body(prompt: list[int], **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def _settled_metrics(srv: TwoEngineServer) -> tuple[str, list[dict]]:
    """/metrics and both engines' own counters, once the engines are idle, their counters did not move
    around the scrape and the coordinator has polled their final figures (or as they stand after 30 s)."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    deadline = time.monotonic() + 30
    while True:
        before = [a.engine.get_stats().scheduler for a in srv.actors]
        text = srv.client.get("/metrics").text
        after = [a.engine.get_stats().scheduler for a in srv.actors]
        engines = [s.spec_decoding for s in after]
        settled = ([s.spec_decoding for s in before] == engines
                   and all(s.num_running == 0 and s.num_waiting == 0 for s in after)
                   and all(metric(text, f"pagedserve:spec_decode_{k}_total") == sum(e[k] for e in engines)
                           for k in keys))
        if settled or time.monotonic() > deadline:
            return text, engines
        time.sleep(0.05)


def test_greedy_completions_equal_plain_streamed_or_not(server, expected):
    for prompt, text in expected.items():
        r = server.client.post("/v1/completions", json=_body(list(prompt)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
        with server.client.stream("POST", "/v1/completions", json=_body(list(prompt), stream=True)) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    # One request of a batch prompt list goes to each engine (least loaded): both speculate.
    r = server.client.post("/v1/completions", json=_body([list(p) for p in expected]))
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == list(expected.values())


def test_metrics_show_spec_counters_summed_over_engines(server):
    # Prompts no engine has cached: the coordinator routes cached prefixes to the engine holding them, and
    # the earlier tests' prompts may all sit on one engine; new ones spread by load, over both.
    server.client.post("/v1/completions", json=_body(repetitive_prompts(4, seed=8)))
    text, engines = _settled_metrics(server)
    assert all(e["num_drafts"] > 0 for e in engines), "both DP engines served and speculated"
    for name, key in (("num_drafts", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
                      ("num_accepted_tokens", "num_accepted_tokens")):
        value = metric(text, f"pagedserve:spec_decode_{name}_total")
        assert value == sum(e[key] for e in engines) and value > 0, name
    per_pos = [metric(text, "pagedserve:spec_decode_num_accepted_tokens_per_pos_total", f'position="{j}"')
               for j in range(3)]
    # Each engine's list grows to the longest draft it has seen.
    assert per_pos == [sum((e["accepted_per_position"] + [0] * 3)[j] for e in engines) for j in range(3)]
    assert per_pos[0] > 0 and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert sum(per_pos) == metric(text, "pagedserve:spec_decode_num_accepted_tokens_total")
    assert "# TYPE pagedserve:spec_decode_num_drafts_total counter" in text


def test_no_spec_metrics_without_speculation():
    text = ServingMetrics("m", lambda: FleetStats(num_running=0)).render()[0].decode()
    assert "spec_decode" not in text
    stats = FleetStats(spec_decoding={"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
                                      "accepted_per_position": [2, 1, 0]})
    text = ServingMetrics("m", lambda: stats).render()[0].decode()
    assert metric(text, "pagedserve:spec_decode_num_accepted_tokens_per_pos_total", 'position="1"') == 1


def _spec(drafts: int, tokens: int, accepted: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": sum(accepted),
            "accepted_per_position": accepted}


def test_coordinator_spec_counters_stay_monotonic_across_restarts():
    coordinator = DPCoordinator([object(), object()], block_size=4)
    first, second = coordinator.engines
    assert coordinator.aggregate_stats().spec_decoding is None
    coordinator._update_stats(first, EngineStats(incarnation="a", stats_time=1.0, spec_decoding=_spec(4, 12, [3, 2])))
    coordinator._update_stats(second, EngineStats(incarnation="x", stats_time=1.0, spec_decoding=_spec(1, 3, [1])))
    # The first engine restarts: its new incarnation counts from zero, the old figures are kept.
    coordinator._update_stats(first, EngineStats(incarnation="b", stats_time=0.5, spec_decoding=_spec(1, 3, [1])))
    spec = coordinator.aggregate_stats().spec_decoding
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (6, 18, 7)
    assert spec["accepted_per_position"] == [5, 2]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 7 / 6)
    assert isinstance(first, EngineState)


def test_serve_client_sums_replicas_and_keeps_gone_ones(monkeypatch):
    client = ServeEngineClient(handle=type("H", (), {"options": lambda self, **kw: self})(), app_name="a",
                               deployment_name="d")
    replicas = [{"replica": "r1", "num_total_blocks": 8, "in_flight": 0, "spec_decoding": _spec(2, 6, [2, 1])},
                {"replica": "r2", "num_total_blocks": 8, "in_flight": 0, "spec_decoding": _spec(1, 3, [0, 0])}]
    monkeypatch.setattr(client, "routing_snapshot", lambda: {"replicas": replicas, "decisions": {}})
    assert client.aggregate_stats().spec_decoding["num_accepted_tokens"] == 3
    replicas.pop(0)  # r1 scaled down: its counts stay in the totals
    spec = client.aggregate_stats().spec_decoding
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["accepted_per_position"]) == (3, 9, [2, 1])


def test_pd_pools_speculate_in_decode_only(model):
    from pagedserve.cluster.serve.pd_app import pool_specs

    args = ServeArgs(model=model, num_prefill_engines=1, num_decode_engines=1, speculative_config=json.dumps(NGRAM))
    specs = pool_specs(args)
    assert specs["decode"].engine_kwargs["speculative_config"]["num_speculative_tokens"] == 3
    assert "speculative_config" not in specs["prefill"].engine_kwargs


def test_bad_speculative_config_names_the_field(model, capsys):
    with pytest.raises(ValidationError, match=r"speculative_config\.num_speculative_tokens"):
        ServeArgs(model=model, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValidationError, match=r"speculative_config\.model: .*does not exist"):
        ServeArgs(model=model, speculative_config={"method": "draft_model", "model": "/no/such/draft",
                                                   "num_speculative_tokens": 2})
    bad = [("{\"method\": \"ngram\", \"num_speculative_tokens\": -1}", "speculative_config.num_speculative_tokens"),
           ("{\"method\": \"medusa\", \"num_speculative_tokens\": 2}", "speculative_config.method"),
           ("{not json", "speculative_config: not valid JSON"),
           ("{\"model\": \"/no/such/draft\", \"num_speculative_tokens\": 2}", "speculative_config.model")]
    for value, named in bad:
        with pytest.raises(SystemExit) as exc:
            main(["serve", model, "--speculative-config", value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("pagedserve serve: error: --speculative-config: ") and named in err, err


# --------------------------------------------------------------------------- benchmarks


def test_code_edit_workload_repeats_its_source(model):
    from pagedserve.bench.workload import code_edit

    tokenizer = load_tokenizer(model)
    sep = len(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    requests = code_edit(5, (40, 60), (8, 16), 3, tokenizer)
    assert requests == code_edit(5, (40, 60), (8, 16), 3, tokenizer)  # seeded
    for r in requests:
        n = len(r.prompt_token_ids)
        assert 40 <= n <= 60 and 8 <= r.output_len <= 16
        s = (n - sep + r.output_len + 1) // 2
        source, copy = r.prompt_token_ids[:s], r.prompt_token_ids[s + sep:]
        assert copy == source[:len(copy)] and s - len(copy) >= r.output_len  # the rest is left to re-emit
    with pytest.raises(ValueError, match="--input-len"):
        code_edit(1, (10, 10), (16, 16), 0, tokenizer)


def test_bench_latency_and_throughput_report_acceptance(model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    spec = json.dumps(NGRAM)
    assert main(["bench", "latency", model, "--input-len", "40", "--output-len", "12", "--batch-size", "2",
                 "--num-iters", "2", "--num-iters-warmup", "0", "--kv-cache-memory", "16MiB", "--workload", "repeat",
                 "--speculative-config", spec, "--no-roofline", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speculative decoding: acceptance rate" in printed and "repeat workload" in printed
    from pagedserve.bench.report import validate_report

    report = json.loads(out.read_text())
    validate_report(report)
    figures = report["runs"][0]["spec_decode"]
    assert figures["num_drafts"] > 0 and 0 <= figures["num_accepted_tokens"] <= figures["num_draft_tokens"]
    assert sum(figures["accepted_per_position"]) == figures["num_accepted_tokens"]
    assert figures["mean_acceptance_length"] == pytest.approx(1 + figures["num_accepted_tokens"] / figures["num_drafts"])
    # Only the timed iterations count: 2 iterations x 2 requests x 11 decode steps at most one draft each.
    assert figures["num_drafts"] <= 2 * 2 * 11

    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", model, "--num-prompts", "3", "--input-len", "40", "--output-len", "10",
                 "--kv-cache-memory", "16MiB", "--workload", "repeat", "--speculative-config", spec, "--no-roofline",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    validate_report(report)
    (run,) = report["runs"]
    assert run["output_tokens"] == 30 and run["spec_decode"]["num_drafts"] > 0
    plain = tmp_path / "plain.json"
    assert main(["bench", "throughput", model, "--num-prompts", "2", "--input-len", "20", "--output-len", "4",
                 "--kv-cache-memory", "16MiB", "--no-roofline", "--output-json", str(plain)]) == 0
    assert "spec_decode" not in json.loads(plain.read_text())["runs"][0]
    capsys.readouterr()
    assert main(["bench", "latency", model, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
                 "--no-roofline"]) == 2
    assert "--speculative-config: speculative_config.num_speculative_tokens" in capsys.readouterr().err
