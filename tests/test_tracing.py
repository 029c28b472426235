"""Per-request tracing (cluster/serving/tracing.py) through the real app over a real engine, with an
in-memory span exporter: one trace per request whose spans cover the path (ingress, routing, the
engine's queue, prefill chunks and decode, the output path) with consistent links and times that add
up, through the monolithic app and the PD app; a migration or an overload retry (migration.py) is an
event and a span holding its new routing decision; a client's `traceparent` continues its trace; the
sample ratio is respected; and with tracing off nothing of OpenTelemetry's SDK is imported (and the
app runs without OpenTelemetry at all)."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator

import pytest
from starlette.testclient import TestClient

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from pagedserve.cluster.cli import build_parser, serve_args_from  # noqa: E402
from pagedserve.cluster.serve.migration import OVERLOAD_BACKOFF_S, MigratingClient  # noqa: E402
from pagedserve.cluster.serving.app import build_fastapi_app  # noqa: E402
from pagedserve.cluster.serving.core import OpenAIServing  # noqa: E402
from pagedserve.cluster.serving.tracing import Tracing  # noqa: E402
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError  # noqa: E402
from pagedserve.engine.outputs import RequestOutput  # noqa: E402
from tests.local_serving import LocalServer, ScriptedCoordinator  # noqa: E402
from tests.pd_local import LocalPD  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "Say something long enough to chunk."}], "max_tokens": 6,
        "ignore_eos": True, "temperature": 0}
TOLERANCE_S = 0.05  # gaps between recorded marks (an await, a thread hop); never a wall-clock assertion of speed


def traced(serving, ratio: float | None = None) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    serving.tracing = Tracing(ratio=ratio, exporter=exporter)
    return exporter


@pytest.fixture(scope="module")
def server(tiny_llama):
    # A small token budget: the prompt is prefilled in several chunks (every time: no prefix cache).
    with LocalServer(str(tiny_llama), engine_kwargs={"max_num_batched_tokens": 8, "enable_chunked_prefill": True,
                                                   "enable_prefix_caching": False}) as local:
        yield local


def by_name(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def seconds(span) -> float:
    return (span.end_time - span.start_time) / 1e9


def top_level(spans, root) -> list:
    return sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                  key=lambda s: s.start_time)


def check_tree(spans) -> object:
    """One trace, one root; every other span's parent is in it and contains it in time. Returns the root."""
    assert len({s.context.trace_id for s in spans}) == 1
    ids = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert len(roots) == 1, [s.name for s in roots]
    for span in spans:
        assert span.end_time >= span.start_time, span.name
        if span is roots[0]:
            continue
        parent = ids[span.parent.span_id]
        slack = int(TOLERANCE_S * 1e9)
        assert parent.start_time - slack <= span.start_time and span.end_time <= parent.end_time + slack, \
            (span.name, parent.name)
    return roots[0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_request_is_one_trace_covering_the_path(server, stream):
    exporter = traced(server.serving)
    try:
        with server.test_client() as client:
            response = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200
        spans = exporter.get_finished_spans()
        root = check_tree(spans)
        names = by_name(spans)
        for stage in ("ingress", "auth", "validate", "tokenize", "prepare", "dispatch", "route", "engine", "queue",
                      "prefill", "prefill_chunk", "decode", "output"):
            assert stage in names, stage
        assert response.headers["x-trace-id"] == format(root.context.trace_id, "032x")
        assert root.attributes["http.response.status_code"] == 200
        assert root.attributes["pagedserve.output_tokens"] == 6
        assert [e.name for e in root.events] == ["first_output"]
        # The prompt is longer than the token budget: several chunks, their tokens the whole prompt.
        chunks = names["prefill_chunk"]
        assert len(chunks) >= 2
        assert sum(c.attributes["pagedserve.tokens"] for c in chunks) == root.attributes["pagedserve.prompt_tokens"]
        route = names["route"][0]
        assert route.attributes["pagedserve.route.decision"] == "single"
        assert route.attributes["pagedserve.route.winner"] == "0"
        # The top-level stages follow each other and add up to the request's end-to-end time.
        top = top_level(spans, root)
        assert [s.name for s in top] == ["ingress", "dispatch", "engine", "output"]
        assert abs(sum(seconds(s) for s in top) - seconds(root)) <= TOLERANCE_S
        engine = names["engine"][0]
        inner = [names[n][0] for n in ("queue", "prefill", "decode")]
        assert abs(sum(seconds(s) for s in inner) - seconds(engine)) <= TOLERANCE_S
    finally:
        server.serving.tracing = None


def test_a_batch_of_prompts_is_one_trace_with_an_engine_leg_each(server):
    exporter = traced(server.serving)
    try:
        with server.test_client() as client:
            response = client.post("/v1/completions", json={"prompt": ["One prompt here.", "And a second one."],
                                                            "max_tokens": 3, "ignore_eos": True, "temperature": 0})
        assert response.status_code == 200
        spans = exporter.get_finished_spans()
        root = check_tree(spans)
        names = by_name(spans)
        assert len(names["engine"]) == len(names["dispatch"]) == len(names["route"]) == 2
        dispatches = {s.context.span_id for s in names["dispatch"]}
        assert all(r.parent.span_id in dispatches for r in names["route"])
        assert root.attributes["pagedserve.output_tokens"] == 6
    finally:
        server.serving.tracing = None


def test_traceparent_continues_the_clients_trace(server):
    exporter = traced(server.serving)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        with server.test_client() as client:
            response = client.post("/v1/chat/completions", json=CHAT,
                                   headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
        assert response.status_code == 200
        spans = exporter.get_finished_spans()
        root = check_tree(spans)
        assert format(root.context.trace_id, "032x") == trace_id
        assert format(root.parent.span_id, "016x") == parent_id
        assert response.headers["x-trace-id"] == trace_id
        assert response.headers["traceparent"].startswith(f"00-{trace_id}-")
    finally:
        server.serving.tracing = None


def test_trace_id_is_in_error_bodies(server):
    traced(server.serving)
    try:
        with server.test_client() as client:
            response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["trace_id"] == response.headers["x-trace-id"]
        assert error["request_id"] == response.headers["x-request-id"]
    finally:
        server.serving.tracing = None


def test_trace_id_is_in_an_error_event_of_a_started_stream(server):
    """An engine failure after the first token: the SSE error event names the trace beside the request."""
    serving = OpenAIServing(ScriptedCoordinator(tokens=2, error=EngineDeadError("the replica died")),
                            server.serving.tokenizer, server.args, server.serving.max_model_len)
    traced(serving)
    with TestClient(build_fastapi_app(serving), raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200  # the status line left with the first token
    (error,) = [json.loads(line[len("data: "):])["error"] for line in response.text.splitlines()
                if line.startswith("data: {") and '"error"' in line]
    assert error["trace_id"] == response.headers["x-trace-id"]
    assert error["request_id"] == response.headers["x-request-id"]


def test_sample_ratio_is_respected(server):
    exporter = traced(server.serving, ratio=0.0)
    try:
        with server.test_client() as client:
            body = {**CHAT, "max_tokens": 1}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert exporter.get_finished_spans() == ()
            # A client's sampled flag wins over the ratio (parent-based sampling).
            sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            assert client.post("/v1/chat/completions", json=body, headers={"traceparent": sampled}).status_code == 200
            assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 1
        exporter.clear()
        server.serving.tracing = Tracing(ratio=1.0, exporter=exporter)
        with server.test_client() as client:
            for _ in range(3):
                assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 3
    finally:
        server.serving.tracing = None


def test_pd_request_is_one_trace_with_both_legs_and_the_kv_transfer(tiny_llama):
    pd = LocalPD(str(tiny_llama))
    try:
        exporter = traced(pd.serving)
        with pd.test_client() as client:
            response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        spans = exporter.get_finished_spans()
        root = check_tree(spans)
        names = by_name(spans)
        for stage in ("ingress", "auth", "validate", "tokenize", "prepare", "dispatch", "route", "engine", "queue",
                      "prefill", "kv_transfer", "decode", "output"):
            assert stage in names, stage
        assert len(names["engine"]) == 2  # the prefill leg, then the decode leg
        assert [e.attributes["pagedserve.deployment"] for e in sorted(names["engine"], key=lambda s: s.start_time)] \
            == ["prefill", "decode"]
        # ingress, then per leg its hand-over and its engine, then the output path: they tile the request.
        top = top_level(spans, root)
        assert [s.name for s in top] == ["ingress", "dispatch", "engine", "dispatch", "engine", "output"]
        assert abs(sum(seconds(s) for s in top) - seconds(root)) <= TOLERANCE_S
        for engine in names["engine"]:
            inner = [s for s in spans if s.parent is not None and s.parent.span_id == engine.context.span_id
                     and s.name in ("queue", "prefill", "decode")]
            assert abs(sum(seconds(s) for s in inner) - seconds(engine)) <= TOLERANCE_S
        assert root.attributes["pagedserve.output_tokens"] == 6
        decisions = {s.attributes["pagedserve.route.deployment"] for s in names["route"]}
        assert decisions == {"prefill", "decode"}
        kv = names["kv_transfer"][0]
        assert kv.attributes["pagedserve.kv.ok"] is True
        assert kv.attributes["pagedserve.kv.bytes"] > 0
        assert kv.attributes["pagedserve.kv.transport"] == "inproc"
        assert kv.attributes["pagedserve.kv.layers"] > 0
    finally:
        pd.close()


class FailsOnce:
    """An engine client whose first stream fails: `EngineDeadError` (its replica died) after `after`
    outputs, or with `refuse` an overload refusal (`EngineOverloadedError`) before the engine took the
    request. Later streams (the resubmissions) run untouched. `tokens_delivered` counts the tokens the
    failed stream passed on: a consumer that falls behind gets several steps folded into one output,
    so `after` outputs may carry more than `after` tokens, and the request may finish within them: the
    replica then dies before its finished output (sooner than `after`), so the first stream always fails."""

    def __init__(self, inner, after: int = 0, refuse: bool = False) -> None:
        self.inner, self.after, self.refuse = inner, after, refuse
        self.failed = False
        self.tokens_delivered = 0

    async def generate(self, request_id: str, *args, **kwargs) -> AsyncIterator[RequestOutput]:
        fail, self.failed = not self.failed, True
        if fail and self.refuse:
            raise EngineOverloadedError(f"{request_id}: the engine's queue is full")
        delivered = 0
        async with contextlib.aclosing(self.inner.generate(request_id, *args, **kwargs)) as stream:
            async for output in stream:
                if fail and (delivered >= self.after or output.finished):
                    raise EngineDeadError(f"the replica serving {request_id} died")
                delivered += 1
                if fail:
                    self.tokens_delivered += sum(len(c.token_ids) for c in output.outputs)
                yield output

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def migrating_app(server, inner: FailsOnce) -> tuple[OpenAIServing, TestClient]:
    serving = OpenAIServing(MigratingClient(inner), server.serving.tokenizer, server.args,
                            server.serving.max_model_len)
    return serving, TestClient(build_fastapi_app(serving), raise_server_exceptions=False)


def test_a_migration_is_an_event_and_a_span_with_its_new_routing(server):
    engine = FailsOnce(server.coordinator, after=2)
    serving, client = migrating_app(server, engine)
    exporter = traced(serving)
    with client:
        response = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200 and "error" not in response.text
    spans = exporter.get_finished_spans()
    root = check_tree(spans)
    names = by_name(spans)
    assert root.attributes["pagedserve.output_tokens"] == 6  # the dead engine's tokens, then the continuation's
    (migration,) = names["migration"]
    assert migration.parent.span_id == root.context.span_id
    assert migration.attributes["pagedserve.retry.attempt"] == 1
    assert migration.attributes["pagedserve.retry.reason"] == "EngineDeadError"
    assert 1 <= engine.tokens_delivered < 6
    assert migration.attributes["pagedserve.retry.tokens_delivered"] == engine.tokens_delivered
    # The continuation's routing decision sits in the migration span; the first one in the first dispatch.
    routes = {s.attributes["pagedserve.route.attempt"]: s for s in names["route"]}
    assert set(routes) == {0, 1}
    assert routes[1].parent.span_id == migration.context.span_id
    assert routes[0].parent.span_id == names["dispatch"][0].context.span_id
    assert len(names["engine"]) == 2  # the engine that died mid-stream, then the one that continued
    assert all(e.attributes["pagedserve.replica"] == "0" for e in names["engine"])  # (the server's one engine)
    events = [e.name for e in root.events]
    assert "migration" in events and "first_output" in events
    (event,) = [e for e in root.events if e.name == "migration"]
    assert event.attributes["pagedserve.retry.attempt"] == 1
    assert server.kv_blocks_when_idle()[0] == server.kv_blocks()[1]


def test_an_overload_retry_is_an_event_and_a_span_holding_its_backoff(server):
    serving, client = migrating_app(server, FailsOnce(server.coordinator, refuse=True))
    exporter = traced(serving)
    with client:
        response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    spans = exporter.get_finished_spans()
    root = check_tree(spans)
    names = by_name(spans)
    (retry,) = names["overload_retry"]
    assert retry.attributes["pagedserve.retry.reason"] == "EngineOverloadedError"
    assert retry.attributes["pagedserve.retry.tokens_delivered"] == 0
    assert seconds(retry) >= OVERLOAD_BACKOFF_S * 0.99  # it waited out the backoff before resubmitting
    (rerouted,) = [s for s in names["route"] if s.attributes["pagedserve.route.attempt"] == 1]
    assert rerouted.parent.span_id == retry.context.span_id
    assert [e.name for e in root.events if e.name == "overload_retry"] == ["overload_retry"]
    assert root.attributes["pagedserve.output_tokens"] == 6


def test_a_pd_prefill_fallback_is_an_event_on_the_trace(tiny_llama):
    pd = LocalPD(str(tiny_llama))
    try:
        pd.client.prefill = FailsOnce(pd.client.prefill, refuse=True)  # the prefill engine refuses: decode computes it
        exporter = traced(pd.serving)
        with pd.test_client() as client:
            response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        spans = exporter.get_finished_spans()
        root = check_tree(spans)
        (event,) = [e for e in root.events if e.name == "prefill_fallback"]
        assert event.attributes["pagedserve.retry.reason"] == "EngineOverloadedError"
        assert len(by_name(spans)["engine"]) == 1 and "kv_transfer" not in by_name(spans)
        assert all(free == total and held == 0 for free, total, held in pd.wait_idle())
    finally:
        pd.close()


class Collector:
    """An OTLP/HTTP trace collector on loopback: keeps each export's spans (decoded protobuf)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        exports: list = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                exports.append((self.path, ExportTraceServiceRequest.FromString(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.exports = exports
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[str, str, str, str]]:
        """(url path, service.name, trace id, span name) of every span received."""
        out = []
        for path, export in self.exports:
            for resource_spans in export.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    out += [(path, service, s.trace_id.hex(), s.name) for s in scope.spans]
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def serving_from_cli(server, *flags: str) -> OpenAIServing:
    ns = build_parser().parse_args(["serve", server.args.model, "--served-model-name", "tiny", *flags])
    return OpenAIServing(server.coordinator, server.serving.tokenizer, serve_args_from(ns), server.serving.max_model_len)


def chat_once(serving: OpenAIServing) -> str:
    with TestClient(build_fastapi_app(serving), raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert response.status_code == 200
    return response.headers["x-trace-id"]


def test_otlp_traces_endpoint_exports_each_request_over_otlp_http(server, collector, monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pagedserve-test")
    serving = serving_from_cli(server, "--otlp-traces-endpoint", collector.url + "/v1/traces",
                               "--trace-sample-ratio", "1")
    assert serving.args.trace_sample_ratio == 1.0
    trace_id = chat_once(serving)
    serving.tracing.shutdown()  # flushes the batch exporter
    spans = collector.spans()
    assert {(path, service, tid) for path, service, tid, _ in spans} == {("/v1/traces", "pagedserve-test", trace_id)}
    assert {"POST /v1/chat/completions", "ingress", "route", "engine", "prefill", "decode"} <= {s[3] for s in spans}


def test_the_app_flushes_batched_spans_as_it_stops(server, collector, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # the batch would wait ten minutes: only a flush sends it
    serving = serving_from_cli(server, "--otlp-traces-endpoint", collector.url + "/v1/traces")
    try:
        trace_id = chat_once(serving)  # the TestClient's exit runs the app's shutdown
        assert {tid for _, _, tid, _ in collector.spans()} == {trace_id}
    finally:
        serving.tracing.shutdown()


def test_otel_environment_turns_tracing_on_samples_and_off(server, collector, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)  # the base URL: the exporter adds /v1/traces
    serving = serving_from_cli(server)
    assert serving.tracing is not None
    trace_id = chat_once(serving)
    serving.tracing.shutdown()
    assert {(path, service, tid) for path, service, tid, _ in collector.spans()} == {("/v1/traces", "pagedserve", trace_id)}
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # the ratio's default: nothing sampled
    collector.exports.clear()
    serving = serving_from_cli(server)
    chat_once(serving)
    serving.tracing.shutdown()
    assert collector.spans() == []
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert serving_from_cli(server, "--otlp-traces-endpoint", collector.url + "/v1/traces").tracing is None


def test_trace_sample_ratio_out_of_range_names_the_flag(server, capsys):
    with pytest.raises(SystemExit):
        serving_from_cli(server, "--trace-sample-ratio", "1.5")
    assert "--trace-sample-ratio: " in capsys.readouterr().err


def run_isolated(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tracing_off_imports_no_opentelemetry(tiny_llama):
    """Off: no SDK or exporter module is loaded by the serving layer, the engine or the Serve clients;
    and with the SDK and exporters made unimportable (what `pip install pagedserve` without [otel]
    leaves: FastAPI itself needs the API package) the app still serves. (The engines are scripted: the engine imports no tracing at all,
    which the first check covers by importing its modules.)"""
    code = f"""
        import json, sys
        block = {{block}}
        if block:
            class Block:
                def find_spec(self, name, path=None, target=None):
                    if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
                        raise ImportError("blocked: " + name)
            sys.meta_path.insert(0, Block())
        import fastapi, starlette.testclient  # FastAPI's own import of the API package, not ours
        base = {{m for m in sys.modules if m.startswith("opentelemetry")}}
        import pagedserve.engine.async_llm, pagedserve.cluster.serve.client, pagedserve.cluster.serve.pd_client
        from starlette.testclient import TestClient
        from pagedserve.cluster.serving.app import build_fastapi_app
        from pagedserve.cluster.serving.core import OpenAIServing
        from pagedserve.cluster.settings import ServeArgs
        from pagedserve.engine.tokenizer import load_tokenizer
        from tests.local_serving import ScriptedCoordinator
        args = ServeArgs(model={str(tiny_llama)!r}, served_model_name="tiny", api_key=None)
        serving = OpenAIServing(ScriptedCoordinator(), load_tokenizer({str(tiny_llama)!r}), args, 256)
        assert serving.tracing is None
        with TestClient(build_fastapi_app(serving)) as client:
            r = client.post("/v1/chat/completions", json={{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2}})
            metrics = client.get("/metrics").text
        print(json.dumps({{"status": r.status_code, "trace_header": "x-trace-id" in r.headers,
                          "stages": "pagedserve:request_stage_seconds_count" in metrics,
                          "loaded": sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))),
                          "added": sorted(m for m in sys.modules if m.startswith("opentelemetry") and m not in base)}}))
    """
    for block in (False, True):
        out = run_isolated(code.replace("{block}", str(block)))
        assert out == {"status": 200, "trace_header": False, "stages": True, "loaded": [], "added": []}


def test_the_otel_extra_installs_what_tracing_imports():
    """`pip install pagedserve[otel]` brings the API, the SDK and the OTLP/HTTP exporter Tracing imports."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extra = {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0] for requirement in project["optional-dependencies"]["otel"]}
    assert extra == {"opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}
    assert not any(r.startswith("opentelemetry") for r in project["dependencies"])  # optional, never required
    source = (Path(__file__).parents[1] / "cluster" / "serving" / "tracing.py").read_text()
    assert "opentelemetry.exporter.otlp.proto.http" in source and "opentelemetry.sdk.trace" in source


def test_endpoint_without_opentelemetry_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_sdk(name, *args, **kwargs):
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with pytest.raises(ValueError, match="otlp_traces_endpoint: .*pagedserve\\[otel\\]"):
        Tracing("http://127.0.0.1:4318/v1/traces")
