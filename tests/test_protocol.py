"""Request/response models, ServeArgs and the CLI's flag mapping, output shaping, and metrics (no Ray)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from pagedserve.cluster.cli import build_parser, serve_args_from
from pagedserve.cluster.serving.metrics import ServingMetrics, token_buckets
from pagedserve.cluster.serving.errors import bad_request
from pagedserve.cluster.serving.formatting import MIN_LOGPROB, chat_logprobs, completion_logprobs, sse
from pagedserve.cluster.serving.requests import ChatCompletionRequest, CompletionRequest
from pagedserve.cluster.serving.tokenization import TokenizeRequest
from pagedserve.cluster.settings import API_KEY_ENV, ServeArgs
from pagedserve.engine.outputs import CompletionOutput, Logprob

ROOT = Path(__file__).resolve().parent.parent


def _loc(exc: ValidationError) -> str:
    return str(exc.errors()[0]["loc"][0])


# --------------------------------------------------------------------------- requests


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    for bad in ([], [[1], []], ["a", [1, 2]], [1, "a"], 5, [True]):
        with pytest.raises(ValidationError) as info:
            CompletionRequest(prompt=bad)
        assert _loc(info.value) == "prompt"


def test_sampling_params_mapping():
    req = CompletionRequest(
        prompt="x", n=2, temperature=0.5, top_p=0.9, presence_penalty=0.1, frequency_penalty=-0.2, seed=7,
        stop="##", logit_bias={"5": 100.0}, logprobs=3, top_k=4, min_p=0.05, min_tokens=2, ignore_eos=True,
        repetition_penalty=1.1, stop_token_ids=[9], include_stop_str_in_output=True, skip_special_tokens=False,
    )
    p = req.to_sampling_params(max_tokens=10)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (2, 0.5, 0.9, 4, 0.05, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, -0.2, 1.1)
    assert p.stop == ["##"] and p.stop_token_ids == [9] and p.include_stop_str_in_output
    assert p.logit_bias == {5: 100.0}
    assert (p.logprobs, p.max_tokens, p.min_tokens, p.ignore_eos, p.skip_special_tokens) == (3, 10, 2, True, False)
    defaults = CompletionRequest(prompt="x").to_sampling_params(max_tokens=16)
    assert defaults.temperature == 1.0 and defaults.top_p == 1.0 and defaults.top_k == 0


def test_chat_request_fields():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = ChatCompletionRequest(messages=msgs, max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=2)
    assert req.conversation() == [{"role": "user", "content": "ab"}]
    assert req.requested_max_tokens() == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert req.requested_logprobs() == 2
    assert ChatCompletionRequest(messages=msgs).requested_logprobs() is None
    assert ChatCompletionRequest(messages=msgs, logprobs=True).requested_logprobs() == 0
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="messages"):
        ChatCompletionRequest(messages=image).conversation()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(tools=[{"type": "function"}]), "tools"),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(stream_options={"include_usage": True}), "stream_options"),
        (dict(n=0), "n"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
    ],
)
def test_chat_request_rejects(kwargs, field):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kwargs)
    error = bad_request(info.value)
    assert error.status == 400
    assert field in (error.info.param or "") or error.info.message.startswith(field), error.info


def test_completion_request_rejects_unsupported():
    for kwargs, field in ((dict(suffix="x"), "suffix"), (dict(best_of=3), "best_of"),
                          (dict(echo=True, logprobs=1), "echo")):
        with pytest.raises(ValidationError) as info:
            CompletionRequest(prompt="x", **kwargs)
        assert bad_request(info.value).info.message.startswith(field) or field in str(info.value)


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        req = CompletionRequest(prompt="x", frobnicate=1, user="me")
    assert req.ignored_fields() == ["frobnicate"]
    assert "frobnicate" in caplog.text
    assert req.user == "me"


def test_sampling_errors_name_the_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt="x", top_k=-4).to_sampling_params(4)
    error = bad_request(info.value)
    assert (error.status, error.info.param) == (400, "top_k")
    error = bad_request(ValueError("stop_token_ids: token ids [9999] are outside the vocabulary"))
    assert error.info.param == "stop_token_ids"
    assert bad_request(ValueError("something odd")).info.param is None


def test_tokenize_request_needs_one_input():
    assert TokenizeRequest(prompt="x").prompt == "x"
    with pytest.raises(ValidationError):
        TokenizeRequest()
    with pytest.raises(ValidationError):
        TokenizeRequest(prompt="x", messages=[{"role": "user", "content": "y"}])


# --------------------------------------------------------------------------- output shaping


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _position(entries):
    return {tid: Logprob(lp, rank, f"tok{tid}") for tid, lp, rank in entries}


def test_completion_logprobs_shape():
    out = CompletionOutput(
        0, "tok5tok7", [5, 7], -3.0,
        [_position([(5, -0.5, 1), (6, -1.0, 2), (8, -2.0, 3)]), _position([(7, -float("inf"), 40), (9, -0.1, 1)])],
    )
    lp = completion_logprobs(out, 2, 10, _Tok())
    assert lp.tokens == ["tok5", "tok7"]
    assert lp.token_logprobs == [-0.5, MIN_LOGPROB]  # -inf clamped: JSON has no infinity
    assert lp.top_logprobs[0] == {"tok5": -0.5, "tok6": -1.0}
    assert lp.top_logprobs[1] == {"tok9": -0.1}  # the sampled token ranks 40: not a top-2 entry
    assert lp.text_offset == [10, 14]
    assert completion_logprobs(out, 0, 0, _Tok()).top_logprobs == [None, None]


def test_chat_logprobs_shape():
    out = CompletionOutput(0, "tok5", [5], -0.5, [_position([(5, -0.5, 1), (6, -1.0, 2), (8, -2.0, 3)])])
    content = chat_logprobs(out, 2, _Tok()).content
    assert len(content) == 1
    assert content[0].token == "tok5" and content[0].bytes == list(b"tok5")
    assert [t.token for t in content[0].top_logprobs] == ["tok5", "tok6"]
    assert all(math.isfinite(t.logprob) for t in content[0].top_logprobs)


def test_sse_framing():
    assert sse("[DONE]") == "data: [DONE]\n\n"
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'


# --------------------------------------------------------------------------- ServeArgs and the CLI


def test_serve_args_defaults_and_engine_kwargs(tiny_llama, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = ServeArgs(model=str(tiny_llama), block_size=4, port=9001, data_parallel_size=2)
    assert args.host == "127.0.0.1" and args.api_key is None
    assert args.model_name == str(tiny_llama)
    kwargs = args.engine_kwargs()
    assert kwargs == {"model": str(tiny_llama), "block_size": 4}  # serve fields are not engine kwargs
    assert ServeArgs.model_validate(args.to_dict()) == args  # build_app(args.to_dict()) sees the same thing
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServeArgs(model=str(tiny_llama)).api_key == "from-env"


def test_serve_args_ship_only_the_api_key_digest(tiny_llama, monkeypatch):
    """Serve shows deployment args in its status: the key itself must not be among them."""
    monkeypatch.setenv(API_KEY_ENV, "s3cret-key")
    args = ServeArgs(model=str(tiny_llama))
    values = args.to_dict()
    assert "api_key" not in values and "s3cret-key" not in repr(values)
    monkeypatch.setenv(API_KEY_ENV, "another-key-in-the-replica")
    replica = ServeArgs.model_validate(values)
    assert replica.api_key_digest == args.api_key_digest == hashlib.sha256(b"s3cret-key").hexdigest()
    with pytest.raises(ValidationError):
        ServeArgs(model=str(tiny_llama), api_key_sha256="not-a-digest")


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(port=70000), "port"),
        (dict(block_size=6), "block_size"),
        (dict(data_parallel_size=0), "data_parallel_size"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(frobnicate=1), "frobnicate"),
        (dict(model="/definitely/not/here"), "model"),
    ],
)
def test_serve_args_reject(tiny_llama, kwargs, field):
    with pytest.raises(ValidationError) as info:
        ServeArgs(**{"model": str(tiny_llama), **kwargs})
    assert _loc(info.value) == field


def test_cli_flags_map_onto_serve_args(tiny_llama):
    ns = build_parser().parse_args([
        "serve", str(tiny_llama), "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
        "--data-parallel-size", "2", "--max-num-seqs", "8", "--max-model-len", "256", "--block-size", "8",
        "--dtype", "float32", "--no-enable-prefix-caching", "--enable-chunked-prefill", "--kv-cache-memory",
        "64MiB", "--api-key", "k", "--served-model-name", "m", "--host", "0.0.0.0", "--port", "8123",
    ])
    args = serve_args_from(ns)
    assert (args.data_parallel_size, args.max_num_seqs, args.max_model_len, args.block_size) == (2, 8, 256, 8)
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is True
    assert (args.api_key, args.model_name, args.host, args.port) == ("k", "m", "0.0.0.0", 8123)
    assert args.engine_kwargs()["enable_prefix_caching"] is False
    assert "host" not in args.engine_kwargs()


def test_cli_scale_out_flags_build_the_serve_deployments(tiny_llama):
    from pagedserve.cluster.serve.app import ROUTER_CLASS, build_app, engine_deployment_options

    ns = build_parser().parse_args([
        "serve", str(tiny_llama), "-dp", "2", "--min-replicas", "1", "--max-replicas", "3",
        "--target-ongoing-requests", "8", "--upscale-delay-s", "2", "--downscale-delay-s", "30",
        "--num-ingress-replicas", "2", "--graceful-shutdown-timeout-s", "45",
    ])
    args = serve_args_from(ns)
    options = engine_deployment_options(args)
    assert options["name"] == "pagedserve-engine" and "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 3,
                                             "target_ongoing_requests": 8.0, "upscale_delay_s": 2.0,
                                             "downscale_delay_s": 30.0}
    assert options["graceful_shutdown_timeout_s"] == 45.0
    assert options["request_router_config"]["request_router_class"] == ROUTER_CLASS
    fixed = engine_deployment_options(serve_args_from(build_parser().parse_args(["serve", str(tiny_llama), "-dp", "3"])))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    app = build_app(args.to_dict())
    ingress = app._bound_deployment
    assert ingress.name == "pagedserve-ingress" and ingress._deployment_config.num_replicas == 2
    with pytest.raises(SystemExit):
        serve_args_from(build_parser().parse_args(["serve", str(tiny_llama), "--min-replicas", "3",
                                                   "--max-replicas", "2"]))


def test_router_class_imports_by_its_config_path():
    import importlib

    from pagedserve.cluster.serve.app import ROUTER_CLASS
    from ray.serve.request_router import RequestRouter

    module, _, name = ROUTER_CLASS.partition(":")
    assert issubclass(getattr(importlib.import_module(module), name), RequestRouter)


def test_cli_bad_flag_exits_with_the_flag_named(tiny_llama, capsys):
    ns = build_parser().parse_args(["serve", str(tiny_llama), "--block-size", "3"])
    with pytest.raises(SystemExit) as info:
        serve_args_from(ns)
    assert info.value.code == 2
    assert "--block-size" in capsys.readouterr().err


def test_cli_generate_runs_offline(tiny_llama, capsys):
    from pagedserve.cluster.cli import main
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    rc = main(["generate", str(tiny_llama), "--prompt", "def fibonacci", "--max-tokens", "6", "--dtype", "float32",
               "--kv-cache-memory", "8MiB", "--block-size", "4"])
    assert rc == 0
    printed = capsys.readouterr().out
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", block_size=4)
    expected = llm.generate("def fibonacci", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    llm.shutdown()
    assert printed == expected[0].outputs[0].text + "\n"


# --------------------------------------------------------------------------- metrics


def test_metrics_names_and_isolated_registries():
    from pagedserve.cluster.engine_stats import EngineStats
    from pagedserve.cluster.fleet_stats import EngineEntry, FleetStats

    stats = FleetStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_free_blocks=30,
                       num_total_blocks=40, prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=3,
                       num_prompt_tokens=120, num_generation_tokens=60,
                       engines=[EngineEntry("0", EngineStats(healthy=True)),
                                EngineEntry("1", EngineStats(healthy=False))])
    a = ServingMetrics("m", lambda: stats, max_model_len=512)
    b = ServingMetrics("m", lambda: FleetStats(), max_model_len=512)  # a second app in the same process: no clash
    a.observe_first_token(0.05)
    a.observe_inter_token(0.01)
    a.observe_finished(0.5, prompt_tokens=7, generation_tokens=3, finish_reason="length")
    text = a.render()[0].decode()
    for line in (
        'pagedserve:num_requests_running{model_name="m"} 2.0',
        'pagedserve:num_requests_waiting{model_name="m"} 1.0',
        'pagedserve:kv_cache_usage_perc{model_name="m"} 0.25',
        'pagedserve:kv_cache_free_blocks{model_name="m"} 30.0',
        'pagedserve:prefix_cache_queries_total{model_name="m"} 100.0',
        'pagedserve:prefix_cache_hits_total{model_name="m"} 40.0',
        'pagedserve:num_preemptions_total{model_name="m"} 3.0',
        'pagedserve:prompt_tokens_total{model_name="m"} 120.0',
        'pagedserve:generation_tokens_total{model_name="m"} 60.0',
        'pagedserve:request_success_total{finished_reason="length",model_name="m"} 1.0',
        'pagedserve:time_to_first_token_seconds_count{model_name="m"} 1.0',
        'pagedserve:inter_token_latency_seconds_count{model_name="m"} 1.0',
        'pagedserve:e2e_request_latency_seconds_sum{model_name="m"} 0.5',
        'pagedserve:request_prompt_tokens_sum{model_name="m"} 7.0',
        'pagedserve:request_generation_tokens_sum{model_name="m"} 3.0',
        'pagedserve:engine_healthy{engine_index="1",model_name="m"} 0.0',
    ):
        assert line in text, line
    assert 'pagedserve:time_to_first_token_seconds_count{model_name="m"} 0.0' in b.render()[0].decode()


def test_metrics_scrape_survives_a_failing_stats_source():
    def broken():
        raise RuntimeError("engine unreachable")

    text = ServingMetrics("m", broken).render()[0].decode()
    assert 'pagedserve:num_requests_running{model_name="m"} 0.0' in text


def test_token_buckets():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(7) == [1, 2, 5]


# --------------------------------------------------------------------------- deployment entry points


def test_serve_config_yaml_is_valid(tiny_llama):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from pagedserve.cluster.serve.app import build_app

    config = yaml.safe_load((ROOT / "manifests" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "pagedserve.cluster.serve.app:build_app" and app.route_prefix == "/"
    args = ServeArgs.model_validate({**app.args, "model": str(tiny_llama)})  # the builder's validation
    assert args.model_name == "pagedserve-default"
    assert (args.max_n, args.max_logprobs, args.trust_request_chat_template) == (16, 20, False)
    assert build_app({**app.args, "model": str(tiny_llama)}) is not None
    with pytest.raises(ValidationError):
        build_app({**app.args, "model": str(tiny_llama), "block_size": 12})


def test_cli_serve_end_to_end(tiny_llama, tmp_path):
    """`pagedserve serve` on its own local Ray: progress, the URL when ready, a request, SIGTERM shutdown."""
    import os
    import queue
    import signal
    import subprocess
    import sys
    import threading

    import httpx

    from pagedserve.cluster.executor.ray_utils import free_port

    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "pagedserve.cluster.cli", "serve", str(tiny_llama), "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory", "16MiB", "--block-size", "4", "--served-model-name", "tiny", "--api-key", "k"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        while not any(line.startswith("pagedserve: ready at") for line in seen):
            try:
                seen.append(lines.get(timeout=240))
            except queue.Empty:
                pytest.fail("no 'ready' line; output:\n" + "".join(seen))
            assert proc.poll() is None, "".join(seen)
        assert any("KV blocks" in line for line in seen), "".join(seen)
        assert f"http://127.0.0.1:{port}/v1" in seen[-1]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, headers={"Authorization": "Bearer k"},
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
