"""Observability shipped and checked: the Grafana dashboard (manifests/observability/) is valid and every
metric its queries read exists in a live /metrics scrape of the app, the PD / KV-transfer / speculative
decoding ones in a live scrape of the PD app with a speculating decode engine (only the Serve router's
decision counts, which need Ray Serve, are checked in what the metrics code emits for that shape); the
scrape configs point at what the KubeRay manifests run; and the overhead histograms
(cluster/serving/overhead.py) agree with the end-to-end ones and carry each engine leg's pool and replica."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.fleet_stats import EngineEntry, FleetStats
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serving.overhead import STAGES
from tests.local_serving import LocalServer
from tests.manifest_checks import MANIFESTS
from tests.pd_local import LocalPD

DASHBOARD = MANIFESTS / "observability" / "grafana-dashboard.json"
METRIC = re.compile(r"pagedserve:[A-Za-z0-9_:]+")
CHAT = {"messages": [{"role": "user", "content": "Tell me about the weather."}], "max_tokens": 5, "ignore_eos": True}

# Figures only some shapes report (PD: KV transfer, pools, paths; speculative decoding; the Serve router's
# decision counts), as the engine clients put them in `aggregate_stats()`: rendered by the real collector.
SHAPE_STATS = {
    "kv_transfer": {"loaded_bytes": 1, "loaded_blocks": 1, "loaded_tokens": 1, "load_failures": 0, "fallbacks": 0,
                    "expired_holds": 0, "held_requests": 0, "held_blocks": 0, "loads": 1, "load_seconds": 0.1},
    "pools": {"prefill": FleetStats(num_running=0, num_waiting=0, num_engines=1)},
    "pd": {"pd_requests": 1},
    "spec_decoding": {"num_drafts": 1, "num_draft_tokens": 2, "num_accepted_tokens": 1, "accepted_per_position": [1]},
    "routing_decisions": {"balanced": 1},
}
SHAPE_PREFIXES = ("pagedserve:kv_transfer_", "pagedserve:pool_", "pagedserve:pd_", "pagedserve:spec_decode_",
                  "pagedserve:routing_decisions")


def sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def dashboard_metrics(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dashboard.get("templating", {}).get("list", []) if isinstance(v.get("query"), str)]
    return {name for expr in exprs for name in METRIC.findall(expr)}


def missing_metrics(dashboard: dict, scraped: set[str], shape_only: set[str]) -> set[str]:
    """Dashboard metrics neither scraped nor emitted by the code for a shape that reports them."""
    found = scraped | {n for n in shape_only if n.startswith(SHAPE_PREFIXES)}
    return dashboard_metrics(dashboard) - found


def shape_metric_names() -> set[str]:
    metrics = ServingMetrics("tiny", lambda: FleetStats(engines=[EngineEntry("0")], **SHAPE_STATS))
    return sample_names(metrics.render()[0].decode())


@pytest.fixture(scope="module")
def scraped(tiny_llama):
    """/metrics of the app after a streamed and a whole chat request (engine stats polled meanwhile)."""
    with LocalServer(str(tiny_llama)) as server, server.test_client() as client:
        for stream in (True, False):
            assert client.post("/v1/chat/completions", json={**CHAT, "stream": stream}).status_code == 200
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}).status_code == 400
        server.kv_blocks_when_idle()
        yield client.get("/metrics").text


def test_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("request rate", "time to first token", "time per output token", "inter-token", "overhead split",
                  "queue depth", "kv cache usage per replica", "prefix-cache hit rate", "routing decisions",
                  "kv transfer", "replicas", "speculative decoding", "errors by http status"):
        assert topic in titles, topic
    # TTFT, TPOT and inter-token latency as percentiles, each from its own histogram.
    for family in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds"):
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"] if f"pagedserve:{family}_bucket" in t["expr"]]
        assert {re.match(r"histogram_quantile\(([0-9.]+),", e).group(1) for e in exprs} == {"0.5", "0.9", "0.99"}, family


def test_every_dashboard_metric_exists(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    assert not missing_metrics(dashboard, sample_names(scraped), shape_metric_names())
    # The overhead split is on the dashboard, read from a live scrape (not only the shape registry).
    assert {"pagedserve:request_stage_seconds_sum", "pagedserve:time_to_first_token_split_seconds_sum"} \
        <= dashboard_metrics(dashboard) & sample_names(scraped)


def test_a_dashboard_query_of_an_unknown_metric_fails(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][0]["targets"][0]["expr"] = "rate(pagedserve:request_sucess_total[5m])"
    assert missing_metrics(dashboard, sample_names(scraped), shape_metric_names()) == {"pagedserve:request_sucess_total"}


def test_overhead_histograms_agree_with_the_end_to_end_ones(scraped):
    rows = samples(scraped)

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in rows if s.name == name and labels.items() <= s.labels.items())

    finished = value("pagedserve:e2e_request_latency_seconds_count")
    assert finished == 2
    for stage in ("ingress", "router", "dispatch", "queue", "prefill", "decode", "output"):
        assert value("pagedserve:request_stage_seconds_count", stage=stage) == finished, stage
    assert {s.labels["stage"] for s in rows if s.name == "pagedserve:request_stage_seconds_count"} <= set(STAGES)
    labelled = [s for s in rows if s.name == "pagedserve:request_stage_seconds_count"]
    assert {(s.labels["deployment"], s.labels["replica"]) for s in labelled} == {("engine", "0")}
    # TTFT = framework + model, request by request: the split's sums add up to the TTFT histogram's.
    for part in ("framework", "model"):
        assert value("pagedserve:time_to_first_token_split_seconds_count", part=part) == finished
    ttft = value("pagedserve:time_to_first_token_seconds_sum")
    split = value("pagedserve:time_to_first_token_split_seconds_sum")
    assert split == pytest.approx(ttft, rel=1e-6, abs=1e-9)
    # Each request made 5 tokens: one TPOT observation per part, which add up to the request's TPOT;
    # the engine's decode is within the e2e time.
    assert value("pagedserve:time_per_output_token_split_seconds_count", part="model") == finished
    assert value("pagedserve:time_per_output_token_seconds_count") == finished
    assert value("pagedserve:time_per_output_token_split_seconds_sum") == pytest.approx(
        value("pagedserve:time_per_output_token_seconds_sum"), rel=1e-6, abs=1e-9)
    assert value("pagedserve:request_stage_seconds_sum", stage="decode") <= value("pagedserve:e2e_request_latency_seconds_sum")
    assert value("pagedserve:request_stage_seconds_sum", stage="queue") + value(
        "pagedserve:request_stage_seconds_sum", stage="prefill") <= ttft + 1e-3


@pytest.fixture(scope="module")
def pd_scraped(tiny_llama):
    """/metrics of the PD app (its decode engine speculating with n-grams) after a chat request."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    pd = LocalPD(str(tiny_llama), decode_kwargs={"speculative_config": ngram})
    try:
        with pd.test_client() as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            pd.wait_idle()
            yield client.get("/metrics").text
    finally:
        pd.close()


def test_the_shape_metrics_are_in_a_live_pd_scrape(pd_scraped):
    """The PD, KV-transfer and speculative-decoding panels read what a live PD app (with a speculating
    decode engine) reports; only the Serve router's decision counts are left to the rendered shape."""
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {n for n in dashboard_metrics(dashboard) if n.startswith(SHAPE_PREFIXES)}
    missing = wanted - sample_names(pd_scraped)
    assert missing <= {"pagedserve:routing_decisions_total"}, missing
    assert {"pagedserve:kv_transfer_bytes_total", "pagedserve:pool_num_engines",
            "pagedserve:spec_decode_num_draft_tokens_total"} <= wanted - missing


def test_pd_overhead_is_labelled_by_each_legs_pool_and_replica(pd_scraped):
    """Through the PD app: the prefill leg's stages on the prefill pool, the decode leg's on the decode pool;
    TTFT split on the prefill pool (its engine made the first token), TPOT split on the decode pool."""
    rows = samples(pd_scraped)

    def pools(name: str, **labels: str) -> set[str]:
        return {s.labels["deployment"] for s in rows if s.name == name and s.value
                and labels.items() <= s.labels.items()}

    stage = "pagedserve:request_stage_seconds_count"
    assert pools(stage, stage="queue") == pools(stage, stage="prefill") == {"prefill", "decode"}
    assert pools(stage, stage="kv_transfer") == {"decode"}
    assert pools(stage, stage="ingress") == {"prefill"} and pools(stage, stage="output") == {"decode"}
    assert pools("pagedserve:time_to_first_token_split_seconds_count") == {"prefill"}
    assert pools("pagedserve:time_per_output_token_split_seconds_count") == {"decode"}
    assert {s.labels["replica"] for s in rows if s.name == stage} == {"0"}  # each pool's one engine


def test_podmonitor_selects_the_kuberay_pods_on_their_serve_port():
    monitor = yaml.safe_load((MANIFESTS / "observability" / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    assert selector["operator"] == "Exists"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for name in ("rayservice-cpu.yaml", "rayservice-gpu.yaml", "rayservice-pd.yaml", "raycluster-cpu.yaml"):
        text = (MANIFESTS / "kuberay" / name).read_text()
        pods = [d for d in yaml.safe_load_all(text) if d and d.get("kind") in ("RayService", "RayCluster")]
        (obj,) = pods
        spec = obj["spec"].get("rayClusterConfig", obj["spec"])
        head = spec["headGroupSpec"]["template"]
        assert selector["key"] in head["metadata"]["labels"], name
        ports = {p.get("name") for c in head["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports, name


def test_prometheus_scrape_config_reads_the_apps_metrics():
    config = yaml.safe_load((MANIFESTS / "observability" / "prometheus-scrape.yaml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["pagedserve"]["metrics_path"] == "/metrics"
    assert jobs["pagedserve"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]  # `pagedserve serve`'s default
