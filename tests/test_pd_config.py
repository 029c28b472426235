"""The PD shape's configuration: ServeArgs and the CLI flags (errors name the flag, incompatible layouts
are refused naming both), the pools each side gets, the PD Serve config manifest through the app
builder, the PD router's decisions, and the /metrics families (no Ray needed)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from pagedserve.cluster.cli import build_parser, serve_args_from
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serve.pd_app import build_pd_app, pool_specs
from pagedserve.cluster.serve.pd_client import prefill_is_answer, prefill_params
from pagedserve.cluster.serve.pd_pools import PoolSpec
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from tests.manifest_checks import ManifestError, build_serve_app, load_yaml, validate_serve_config
from tests.pd_local import metric, metric_samples

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "serve_config_pd.yaml"


def pd_args(model, **overrides) -> ServeArgs:
    return ServeArgs(model=str(model), num_prefill_engines=2, num_decode_engines=1, **overrides)


def test_pd_args_and_the_pools_they_describe(tiny_llama):
    args = pd_args(tiny_llama, prefill_tensor_parallel_size=2, decode_pipeline_parallel_size=2, block_size=8,
                   prefill_resources={"prefill_node": 1}, kv_connector_extra_config={"hold_timeout_s": 30})
    assert args.disaggregated and not ServeArgs(model=str(tiny_llama)).disaggregated
    specs = pool_specs(args)
    assert (specs["prefill"].num_engines, specs["decode"].num_engines) == (2, 1)
    assert specs["prefill"].engine_kwargs["tensor_parallel_size"] == 2
    assert specs["prefill"].engine_kwargs["pipeline_parallel_size"] == 1
    assert specs["decode"].engine_kwargs["pipeline_parallel_size"] == 2
    assert specs["decode"].engine_kwargs["block_size"] == 8
    assert specs["prefill"].resources == {"prefill_node": 1.0} and specs["decode"].resources == {}
    kwargs = specs["prefill"].engine_kwargs_for("app-prefill-0", "serve")
    kv = kwargs["kv_transfer_config"]
    assert kv["kv_role"] == "kv_producer" and kv["engine_id"] == "app-prefill-0"
    assert kv["kv_connector_extra_config"] == {"hold_timeout_s": 30, "ray_actor_name": "app-prefill-0",
                                               "ray_namespace": "serve"}
    assert specs["decode"].engine_kwargs_for("d", "ns")["kv_transfer_config"]["kv_role"] == "kv_consumer"


def test_the_app_secret_reaches_every_engine_and_no_repr(tiny_llama, monkeypatch):
    import pickle

    from pydantic import SecretStr

    from pagedserve.cluster.serve.pd_pools import deployment_kv_secret
    from pagedserve.engine.config import EngineConfig

    monkeypatch.delenv("PAGEDSERVE_KV_SECRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KV_SECRET_FILE", raising=False)
    secret = deployment_kv_secret()
    assert isinstance(secret, SecretStr) and secret != deployment_kv_secret()  # fresh per app start
    specs = pool_specs(pd_args(tiny_llama, kv_connector="torch_p2p"), kv_secret=secret)
    configs = []
    for role, name in (("prefill", "p-0"), ("decode", "d-0")):
        kwargs = specs[role].engine_kwargs_for(name, "ns")
        # The trip to the engine actor: Ray pickles the constructor's arguments.
        config = EngineConfig(**pickle.loads(pickle.dumps(kwargs)))
        configs.append(config)
        kv = config.kv_transfer_config
        assert kv["kv_secret"].get_secret_value() == secret.get_secret_value()
        for text in (repr(kwargs), str(kwargs), repr(specs[role]), repr(config), str(kv)):
            assert secret.get_secret_value() not in text
    from pagedserve.kv_transfer.config import parse_kv_transfer_config

    assert len({parse_kv_transfer_config(c.kv_transfer_config).secret() for c in configs}) == 1
    # An operator's secret wins: the app generates none and every engine reads the environment.
    monkeypatch.setenv("PAGEDSERVE_KV_SECRET", "operator-secret-0123456789")
    assert deployment_kv_secret() is None
    monkeypatch.delenv("PAGEDSERVE_KV_SECRET")
    monkeypatch.setenv("PAGEDSERVE_KV_SECRET_FILE", "/run/secrets/kv")
    assert deployment_kv_secret() is None
    assert "kv_secret" not in pool_specs(pd_args(tiny_llama))["prefill"].engine_kwargs_for("p", "ns")["kv_transfer_config"]


@pytest.mark.parametrize("overrides, field", [
    ({"num_prefill_engines": 1}, "num_decode_engines"),
    ({"num_decode_engines": 1}, "num_prefill_engines"),
    ({"num_prefill_engines": 1, "num_decode_engines": 1, "kv_connector": "inproc"}, "kv_connector"),
    ({"num_prefill_engines": 1, "num_decode_engines": 1, "kv_connector": "carrier_pigeon"}, "kv_connector"),
    ({"num_prefill_engines": 1, "num_decode_engines": 1, "max_replicas": 3}, "data_parallel_size"),
    ({"num_prefill_engines": 1, "num_decode_engines": 1, "kv_connector_extra_config": {"read_timeout_s": 0}},
     "kv_connector_extra_config"),
    ({"num_prefill_engines": 1, "num_decode_engines": 1, "kv_transfer_config": {"kv_connector": "ray",
                                                                                "kv_role": "kv_both"}},
     "kv_transfer_config"),
    ({"num_prefill_engines": 0, "num_decode_engines": 1}, "num_prefill_engines"),
])
def test_bad_pd_args_name_the_field(tiny_llama, overrides, field):
    with pytest.raises(ValueError, match=field):
        ServeArgs(model=str(tiny_llama), **overrides)


def test_a_layout_pair_that_cannot_exchange_kv_is_refused_naming_both(tiny_llama):
    # The tiny model has 2 KV heads: TP=3 cannot re-slice them.
    with pytest.raises(ValueError) as info:
        pd_args(tiny_llama, decode_tensor_parallel_size=3)
    message = str(info.value)
    assert "decode_tensor_parallel_size" in message
    assert "prefill layout" in message and "TP=1" in message and "decode layout" in message and "TP=3" in message
    with pytest.raises(ValueError, match="prefill_pipeline_parallel_size"):
        pd_args(tiny_llama, prefill_pipeline_parallel_size=3)  # 3 stages for 2 layers


def test_cli_flags(tiny_llama, capsys):
    parser = build_parser()
    ns = parser.parse_args(["serve", str(tiny_llama), "--num-prefill-engines", "2", "--num-decode-engines", "3",
                            "--prefill-tensor-parallel-size", "2", "--decode-pipeline-parallel-size", "2",
                            "--kv-connector", "ray", "--decode-resources", '{"decode_node": 1}',
                            "--kv-connector-extra-config", '{"hold_timeout_s": 5}'])
    args = serve_args_from(ns)
    assert (args.num_prefill_engines, args.num_decode_engines) == (2, 3)
    assert (args.prefill_tensor_parallel_size, args.decode_pipeline_parallel_size) == (2, 2)
    assert args.decode_resources == {"decode_node": 1.0} and args.kv_connector_extra_config == {"hold_timeout_s": 5}
    for flags, flag in ((["--num-prefill-engines", "1"], "--num-decode-engines"),
                        (["--num-prefill-engines", "1", "--num-decode-engines", "1", "--decode-tensor-parallel-size",
                          "3"], "--decode-tensor-parallel-size"),
                        (["--num-prefill-engines", "1", "--num-decode-engines", "1", "--kv-connector", "inproc"],
                         "--kv-connector")):
        with pytest.raises(SystemExit):
            serve_args_from(parser.parse_args(["serve", str(tiny_llama), *flags]))
        assert f"error: {flag}:" in capsys.readouterr().err


def test_pool_spec_refusals():
    with pytest.raises(ValueError, match="inproc"):
        PoolSpec("prefill", 1, {}, kv_connector="inproc")
    with pytest.raises(ValueError, match="decode_resources"):
        PoolSpec("decode", 1, {}, resources={"GPU": 1})
    with pytest.raises(ValueError, match="num_prefill_engines"):
        PoolSpec("prefill", 0, {})


def test_pd_serve_config_builds_the_pd_app(tiny_llama):
    config = load_yaml(MANIFEST)
    validate_serve_config(config)
    app = config["applications"][0]
    built = build_serve_app(app, tiny_llama)
    ingress = built._bound_deployment
    assert ingress.name == f"{app['args']['app_name']}-ingress"
    pools = ingress.init_args[2]  # the ingress's upstream (args, connect, upstream): both pools
    assert {role: a._bound_deployment.name for role, a in pools.items()} == {
        role: f"{app['args']['app_name']}-{role}" for role in ("prefill", "decode")}
    broken = copy.deepcopy(app)
    del broken["args"]["num_decode_engines"]
    with pytest.raises(ManifestError, match="num_decode_engines"):
        build_serve_app(broken, tiny_llama)
    broken = copy.deepcopy(app)
    broken["args"].update(model=str(tiny_llama), decode_tensor_parallel_size=3)  # 2 KV heads
    with pytest.raises(ManifestError, match="decode layout"):
        build_serve_app(broken, tiny_llama)


def test_build_pd_app_names_its_deployments(tiny_llama):
    built = build_pd_app(pd_args(tiny_llama, app_name="demo", num_ingress_replicas=2))
    assert built._bound_deployment.name == "demo-ingress"
    assert built._bound_deployment.num_replicas == 2


def _final(reason: str | None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], None, [CompletionOutput(0, "x", [5], None, None, reason)], True)


def test_prefill_stage_params_and_when_its_output_is_the_answer():
    user = {"n": 3, "max_tokens": 50, "min_tokens": 4, "temperature": 0.7, "seed": 5, "prompt_logprobs": None,
            "logprobs": 2, "stop": ["x"], "kv_transfer_params": None}
    params = prefill_params(user)
    assert params["n"] == 1 and params["max_tokens"] == 1 and params["min_tokens"] == 1
    assert params["kv_transfer_params"] == {"do_remote_decode": True}
    assert (params["temperature"], params["seed"], params["stop"], params["logprobs"]) == (0.7, 5, ["x"], 2)
    assert not prefill_is_answer(user, _final("stop"))  # n=3: the decode engine makes all three
    single = {**user, "n": 1}
    assert prefill_is_answer(single, _final("stop"))  # the first token ended it (EOS / stop)
    assert not prefill_is_answer(single, _final("length"))  # only max_tokens=1 of 50 was reached
    assert prefill_is_answer({**single, "max_tokens": 1}, _final("length"))


def test_metrics_families_of_the_pd_shape():
    from pagedserve.cluster.fleet_stats import EngineEntry, FleetStats

    stats = FleetStats(
        num_running=3, engines=[EngineEntry("prefill-0", pool="prefill"), EngineEntry("decode-0", pool="decode")],
        kv_transfer={"loaded_bytes": 4096, "loaded_blocks": 8, "loaded_tokens": 30, "loads": 2,
                     "load_seconds": 0.5, "load_failures": 1, "fallbacks": 1, "held_requests": 2,
                     "held_blocks": 5, "expired_holds": 0},
        pools={"prefill": FleetStats(num_running=1, num_waiting=4, num_engines=1),
               "decode": FleetStats(num_running=2, num_waiting=0, num_engines=1)},
        pd={"pd_requests": 7, "prefill_answers": 1, "decode_only": 0, "prefill_fallbacks": 2},
    )
    text = ServingMetrics("m", lambda: stats).render()[0].decode()
    assert metric(text, "pagedserve:kv_transfer_bytes_total") == 4096
    assert metric(text, "pagedserve:kv_transfer_blocks_pulled_total") == 8
    assert metric(text, "pagedserve:kv_transfer_failures_total") == 1
    assert metric(text, "pagedserve:kv_transfer_fallbacks_total") == 1
    assert metric(text, "pagedserve:kv_transfer_held_blocks") == 5
    assert metric(text, "pagedserve:kv_transfer_time_seconds_sum") == 0.5
    assert metric(text, "pagedserve:kv_transfer_time_seconds_count") == 2
    waiting = metric_samples(text, "pagedserve:pool_num_requests_waiting")
    assert waiting == {'{model_name="m",pool="prefill"}': 4.0, '{model_name="m",pool="decode"}': 0.0}
    assert metric_samples(text, "pagedserve:pd_requests_total")['{model_name="m",path="prefill_fallbacks"}'] == 2
    monolithic = ServingMetrics("m", lambda: FleetStats(num_running=1)).render()[0].decode()
    assert "kv_transfer" not in monolithic and "pool_num_requests" not in monolithic


def test_kv_transfer_counters_stay_monotonic_across_engine_restarts():
    """A pool's accumulator (what PDClient's pools keep) carries a restarted engine's KV-transfer counters."""
    from pagedserve.cluster.engine_stats import EngineStats
    from pagedserve.cluster.fleet_stats import FleetAccumulator

    pool = FleetAccumulator()

    def totals(incarnation: str, loaded: int, held: int) -> dict:
        pool.observe("decode-0", EngineStats(incarnation=incarnation,
                                             kv_transfer={"loaded_bytes": loaded, "held_requests": held}))
        return pool.snapshot([]).kv_transfer

    assert totals("a", 100, 2) == {"loaded_bytes": 100, "held_requests": 2}
    assert totals("a", 150, 1) == {"loaded_bytes": 150, "held_requests": 1}
    # restarted: its counters start from zero again; the total goes on from 150, the gauge does not
    assert totals("b", 10, 0) == {"loaded_bytes": 160, "held_requests": 0}
    assert totals("b", 30, 3) == {"loaded_bytes": 180, "held_requests": 3}


def test_pool_autoscaling_flags_and_the_deployments_they_describe(tiny_llama):
    from pagedserve.cluster.serve.pd_app import pool_deployment_options
    from pagedserve.cluster.serve.pd_autoscaling import POLICY_FUNCTION

    args = pd_args(tiny_llama, prefill_min_replicas=1, prefill_max_replicas=3, decode_max_replicas=4,
                   prefill_target_queued_prompt_tokens=512, decode_target_num_seqs=8, decode_target_kv_usage=0.5,
                   decode_resources={"decode_node": 1}, prefill_tensor_parallel_size=2,
                   prefill_resources={"prefill_node": 1}, autoscaling_look_back_period_s=5, app_name="demo")
    specs = pool_specs(args)
    prefill = pool_deployment_options(args, specs["prefill"])
    assert prefill["name"] == "demo-prefill" and "num_replicas" not in prefill
    scaling = prefill["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"]) == (1, 2, 3)
    assert scaling["look_back_period_s"] == 5
    assert scaling["policy"] == {"policy_function": POLICY_FUNCTION, "policy_kwargs": {
        "metric": "queued_prompt_tokens", "target": 512}}
    # TP=2: the replica and both ranks in one placement group, every bundle pinned to prefill nodes
    assert [b["prefill_node"] for b in prefill["placement_group_bundles"]] == [1.0, 1.0, 1.0]
    decode = pool_deployment_options(args, specs["decode"])
    assert decode["name"] == "demo-decode"
    assert (decode["autoscaling_config"]["min_replicas"], decode["autoscaling_config"]["max_replicas"]) == (1, 4)
    assert decode["autoscaling_config"]["policy"]["policy_kwargs"] == {"metric": "num_seqs", "target": 8,
                                                                      "kv_usage_target": 0.5}
    assert decode["ray_actor_options"]["resources"] == {"decode_node": 1.0}
    assert "placement_group_bundles" not in decode
    for options in (prefill, decode):
        assert options["request_router_config"]["request_router_class"].endswith(":PrefixAffinityRouter")
    fixed = pool_deployment_options(pd_args(tiny_llama), pool_specs(pd_args(tiny_llama))["prefill"])
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    with pytest.raises(ValueError, match="decode_max_replicas"):
        pd_args(tiny_llama, decode_min_replicas=3, decode_max_replicas=2)
    with pytest.raises(ValueError, match="prefill_min_replicas"):
        ServeArgs(model=str(tiny_llama), prefill_min_replicas=1)  # not a PD app
    parser = build_parser()
    ns = parser.parse_args(["serve", str(tiny_llama), "--num-prefill-engines", "1", "--num-decode-engines", "1",
                            "--decode-min-replicas", "1", "--decode-max-replicas", "3",
                            "--decode-target-kv-usage", "0.7", "--prefill-target-queued-prompt-tokens", "100"])
    args = serve_args_from(ns)
    assert (args.decode_min_replicas, args.decode_max_replicas, args.decode_target_kv_usage) == (1, 3, 0.7)
    assert args.prefill_target_queued_prompt_tokens == 100


def test_role_autoscaling_policy_sums_each_roles_signal():
    from types import SimpleNamespace

    from pagedserve.cluster.serve.pd_autoscaling import RoleAutoscalingPolicy

    prefill = RoleAutoscalingPolicy("queued_prompt_tokens", 100)
    assert prefill.desired({}) is None  # nothing reported yet: Serve keeps the current target
    assert prefill.desired({"queued_prompt_tokens": {"a": 150.0, "b": 90.0}, "num_seqs": {"a": 99.0}}) == 2.4
    decode = RoleAutoscalingPolicy("num_seqs", 4, kv_usage_target=0.5)
    assert decode.desired({"num_seqs": {"a": 2.0}, "kv_cache_usage": {"a": 0.1}}) == 0.5
    assert decode.desired({"num_seqs": {"a": 2.0}, "kv_cache_usage": {"a": 0.9, "b": 0.6}}) == 3.0  # KV-bound
    ctx = SimpleNamespace(aggregated_metrics=None, target_num_replicas=2)
    assert decode(ctx) == (2, {})
    with pytest.raises(ValueError, match="kv_usage_target"):
        RoleAutoscalingPolicy("num_seqs", 4, kv_usage_target=1.5)
