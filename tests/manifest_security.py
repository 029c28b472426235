"""Security checks behind tests/test_manifests.py: what a deployment file must lock down, read from the file.

KubeRay manifests (a RayCluster or RayService plus its NetworkPolicy, one file):
- Secrets: every `secretKeyRef`/`secretRef`/secret volume is required (never `optional: true`: a missing
  Secret must stop the pod, not start it without auth), and every Ray pod (an ingress replica may run on
  any of them, the engines on the workers) gets the API key as `PAGEDSERVE_API_KEY` and the KV transport's
  deployment secret as `PAGEDSERVE_KV_SECRET`, each from its Secret.
- Containers: every one (head, workers, the autoscaler sidecar KubeRay adds) runs as the image's non-root
  uid (the Dockerfile's USER), without privilege escalation, with every capability dropped and the
  runtime's default seccomp profile, and has CPU and memory requests and limits.
- Ray: token authentication (`authOptions.mode: token`, and RAY_AUTH_MODE=token in the Ray containers).
- NetworkPolicy: one covers every pod of the cluster (by the pod templates' labels) and admits the
  deployment's own pods on every port, anyone on the Serve port only, and (RayService) the KubeRay
  operator on the dashboard port only.

`ray up` configs: RAY_AUTH_MODE=token in every command that starts or talks to Ray, the operator's token
file mounted where Ray reads it on every node, the dashboard on the head's loopback.

Every check raises `ManifestError` naming the file's object, group or container and the offending key.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from tests.manifest_checks import ROOT, ManifestError, check_label, cluster_spec, pod_groups, ray_object

# The env var -> (Secret, key) every Ray pod reads; the names `kubectl create secret` makes (README).
SECRET_ENV = {
    "PAGEDSERVE_API_KEY": ("pagedserve-api-key", "api-key"),
    "PAGEDSERVE_KV_SECRET": ("pagedserve-kv-secret", "kv-secret"),
}
# The label every pod template carries and the NetworkPolicy selects (value: the RayCluster/RayService name).
DEPLOYMENT_LABEL = "pagedserve/deployment"
SERVE_PORT = 8000
DASHBOARD_PORT = 8265
# The KubeRay operator's pods (its Helm chart's label): the RayService controller calls the head's dashboard.
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
SECCOMP_TYPES = ("RuntimeDefault", "Localhost")


def image_user(dockerfile: str | None = None) -> tuple[int, int]:
    """(uid, gid) of the image's final USER: numeric and not root, so runAsNonRoot can verify it."""
    text = dockerfile if dockerfile is not None else (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)\s*$", text, re.M)
    if not users:
        raise ManifestError("Dockerfile: no USER: the image runs as root")
    match = re.fullmatch(r"(\d+):(\d+)", users[-1])
    if match is None:
        raise ManifestError(f"Dockerfile: the final USER {users[-1]!r} must be numeric uid:gid for runAsNonRoot")
    uid, gid = int(match.group(1)), int(match.group(2))
    if uid == 0:
        raise ManifestError("Dockerfile: the final USER is root (uid 0)")
    return uid, gid


# --------------------------------------------------------------------------- Secrets


def _walk(value: Any, path: str) -> Iterator[tuple[str, dict]]:
    if isinstance(value, dict):
        yield path, value
        for key, sub in value.items():
            yield from _walk(sub, f"{path}.{key}")
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _walk(sub, f"{path}[{i}]")


def check_secret_refs_required(spec: dict, where: str) -> None:
    """No Secret reference anywhere in the cluster spec may be optional."""
    for path, node in _walk(spec, where):
        for key in ("secretKeyRef", "secretRef"):
            if isinstance(node.get(key), dict) and node[key].get("optional"):
                raise ManifestError(f"{path}.{key} ({node[key].get('name')}): optional: true starts the pod "
                                    "without the Secret; it must be required")
        if isinstance(node.get("secret"), dict) and node["secret"].get("optional"):
            raise ManifestError(f"{path}.secret ({node['secret'].get('secretName')}): optional: true; must be required")


def check_secret_env(container: dict, where: str) -> None:
    """The container reads both deployment Secrets into their env vars (required references)."""
    env = {e["name"]: e for e in container.get("env") or []}
    for name, (secret, key) in SECRET_ENV.items():
        ref = ((env.get(name) or {}).get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            raise ManifestError(f"{where}: no {name} from Secret {secret}/{key}: this pod can host an ingress "
                                "replica or an engine")
        if (ref.get("name"), ref.get("key")) != (secret, key):
            raise ManifestError(f"{where}: {name} reads Secret {ref.get('name')}/{ref.get('key')}, expected {secret}/{key}")
        if ref.get("optional"):
            raise ManifestError(f"{where}: {name}: optional: true; the Secret must be required")


# --------------------------------------------------------------------------- containers


def _effective_security(pod: dict, container_sc: dict | None) -> dict:
    """The container's security settings with the pod's defaults under them (Kubernetes' precedence)."""
    pod_sc = pod.get("securityContext") or {}
    inherited = {k: pod_sc[k] for k in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile") if k in pod_sc}
    return {**inherited, **(container_sc or {})}


def check_container_security(container_sc: dict | None, pod: dict, where: str, uid: int) -> None:
    if not container_sc:
        raise ManifestError(f"{where}: no securityContext")
    sc = _effective_security(pod, container_sc)
    if sc.get("runAsNonRoot") is not True:
        raise ManifestError(f"{where}: securityContext.runAsNonRoot must be true")
    if sc.get("runAsUser") != uid:
        raise ManifestError(f"{where}: securityContext.runAsUser {sc.get('runAsUser')!r}, the image's user is uid {uid}")
    if container_sc.get("allowPrivilegeEscalation") is not False:
        raise ManifestError(f"{where}: securityContext.allowPrivilegeEscalation must be false")
    if container_sc.get("privileged"):
        raise ManifestError(f"{where}: securityContext.privileged")
    capabilities = container_sc.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []) or capabilities.get("add"):
        raise ManifestError(f"{where}: securityContext.capabilities must drop [ALL] and add none, not {capabilities}")
    if (sc.get("seccompProfile") or {}).get("type") not in SECCOMP_TYPES:
        raise ManifestError(f"{where}: securityContext.seccompProfile.type {sc.get('seccompProfile')!r}, "
                            "expected RuntimeDefault")


def check_container_resources(resources: dict | None, where: str) -> None:
    resources = resources or {}
    for kind in ("requests", "limits"):
        missing = {"cpu", "memory"} - set(resources.get(kind) or {})
        if missing:
            raise ManifestError(f"{where}: resources.{kind} lacks {sorted(missing)}")


def check_containers(spec: dict, where: str, uid: int) -> None:
    """Every container of every pod template, and the autoscaler sidecar, is locked down and bounded."""
    for group, _, pod in pod_groups(spec):
        for kind in ("initContainers", "containers"):
            for container in pod.get(kind) or []:
                at = f"{where}/{group}/{container.get('name')}"
                check_container_security(container.get("securityContext"), pod, at, uid)
                check_container_resources(container.get("resources"), at)
    if spec.get("enableInTreeAutoscaling"):  # KubeRay adds the sidecar to the head pod from autoscalerOptions
        options = spec.get("autoscalerOptions") or {}
        head_pod = spec["headGroupSpec"]["template"]["spec"]
        at = f"{where}/head/autoscaler (autoscalerOptions)"
        check_container_security(options.get("securityContext"), head_pod, at, uid)
        check_container_resources(options.get("resources"), at)


# --------------------------------------------------------------------------- Ray auth


def check_ray_auth(spec: dict, where: str) -> None:
    """Ray token authentication: KubeRay's authOptions, and RAY_AUTH_MODE=token in every Ray container (so a
    pod started by an operator that ignores authOptions has no token and does not start, instead of running
    open)."""
    mode = (spec.get("authOptions") or {}).get("mode")
    if mode != "token":
        raise ManifestError(f"{where}: authOptions.mode {mode!r}: Ray token authentication must be on (mode: token)")
    for group, _, pod in pod_groups(spec):
        container = pod["containers"][0]  # the Ray container (KubeRay's RayContainerIndex)
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        if env.get("RAY_AUTH_MODE") != "token":
            raise ManifestError(f"{where}/{group}/{container['name']}: RAY_AUTH_MODE {env.get('RAY_AUTH_MODE')!r}, "
                                "expected 'token'")
    for e in (spec.get("autoscalerOptions") or {}).get("env") or []:
        if e["name"] == "RAY_AUTH_MODE" and e.get("value") != "token":
            raise ManifestError(f"{where}: autoscalerOptions.env RAY_AUTH_MODE {e.get('value')!r}")


# --------------------------------------------------------------------------- NetworkPolicy


def selector_matches(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector against a pod's labels (an empty selector matches every pod)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for requirement in selector.get("matchExpressions") or []:
        key, op, values = requirement["key"], requirement["operator"], requirement.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(ray: dict, where: str) -> dict[str, dict[str, str]]:
    """group -> the labels of its pods: the template's, under the ones KubeRay sets itself (its labelPod:
    ray.io/node-type, ray.io/group and ray.io/cluster win over the template). A RayService's RayCluster has a
    generated name, so its pods' ray.io/cluster is left out: no policy can rely on it."""
    spec = cluster_spec(ray)
    labels = {}
    for group, _, _ in pod_groups(spec):
        template = spec["headGroupSpec"]["template"] if group == "head" else next(
            g["template"] for g in spec["workerGroupSpecs"] if g["groupName"] == group)
        own = dict((template.get("metadata") or {}).get("labels") or {})
        for key, value in own.items():
            check_label(key, value, f"{where}/{group}: template.metadata.labels")
        kuberay = {"ray.io/is-ray-node": "yes", "app.kubernetes.io/name": "kuberay",
                   "app.kubernetes.io/created-by": "kuberay-operator"}
        fixed = {"ray.io/node-type": "head" if group == "head" else "worker",
                 "ray.io/group": "headgroup" if group == "head" else group}
        if ray["kind"] == "RayCluster":
            fixed["ray.io/cluster"] = ray["metadata"]["name"]
        labels[group] = {**kuberay, **own, **fixed}
    return labels


def _selects_only(selector: dict | None, required: list[dict[str, str]]) -> bool:
    """The selector's matchLabels pin one of the `required` label sets (so it matches no pod without it)."""
    pinned = (selector or {}).get("matchLabels") or {}
    return selector is not None and any(all(pinned.get(k) == v for k, v in r.items()) for r in required)


def _peer_kind(peer: dict, own: list[dict[str, str]]) -> str:
    """'own' (only the deployment's pods), 'operator' (the KubeRay operator's pods) or 'other'."""
    if "ipBlock" in peer:
        return "other"
    if "namespaceSelector" not in peer and _selects_only(peer.get("podSelector"), own):
        return "own"
    if _selects_only(peer.get("podSelector"), [OPERATOR_LABELS]):
        return "operator"
    return "other"


def admitted(policies: list[dict], own: list[dict[str, str]]) -> dict[str, set[int] | None]:
    """What the policies' ingress rules let in, by peer kind: a set of TCP ports, or None for every port."""
    result: dict[str, set[int] | None] = {}
    for policy in policies:
        for i, rule in enumerate(policy["spec"].get("ingress") or []):
            kinds = {_peer_kind(p, own) for p in rule.get("from") or []} or {"other"}  # no `from`: anyone
            ports: set[int] | None = None
            if rule.get("ports"):
                ports = set()
                for port in rule["ports"]:
                    if not isinstance(port.get("port"), int) or port.get("protocol", "TCP") != "TCP":
                        raise ManifestError(f"NetworkPolicy {policy['metadata']['name']}: ingress[{i}]: name TCP ports "
                                            f"by number, not {port}")
                    ports |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
            for kind in kinds:
                if kind in result and result[kind] is None:
                    continue
                result[kind] = None if ports is None else (result.get(kind) or set()) | ports
    return result


def check_network_policy(ray: dict, policies: list[dict], where: str) -> None:
    """A NetworkPolicy covers every pod of the RayCluster and admits only what the deployment needs."""
    name = ray["metadata"]["name"]
    labels = pod_labels(ray, where)
    own = [{DEPLOYMENT_LABEL: name}] + ([{"ray.io/cluster": name}] if ray["kind"] == "RayCluster" else [])
    for group, group_labels in labels.items():
        if group_labels.get(DEPLOYMENT_LABEL) != name:
            raise ManifestError(f"{where}/{group}: the pod template lacks the label {DEPLOYMENT_LABEL}: {name}")
    ingress = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]]
    for group, group_labels in labels.items():
        if not any(selector_matches(p["spec"]["podSelector"], group_labels) for p in ingress):
            raise ManifestError(f"{where}/{group}: no NetworkPolicy (Ingress) covers this group's pods "
                                f"(labels {group_labels}): anything in the cluster reaches its Ray ports")
    covering = [p for p in ingress if any(selector_matches(p["spec"]["podSelector"], g) for g in labels.values())]
    allowed = admitted(covering, own)
    if allowed.get("own", set()) is not None:
        raise ManifestError(f"{where}: the NetworkPolicy must admit the deployment's own pods on every port "
                            f"(Ray's ports are random), admits {sorted(allowed.get('own') or [])}")
    outside = allowed.get("other", set())
    if outside is None:
        raise ManifestError(f"{where}: a NetworkPolicy rule admits every port from outside the deployment")
    if outside - {SERVE_PORT}:
        raise ManifestError(f"{where}: the NetworkPolicy admits ports {sorted(outside - {SERVE_PORT})} from outside the "
                            f"deployment; only the Serve port {SERVE_PORT}")
    if SERVE_PORT not in outside:
        raise ManifestError(f"{where}: the NetworkPolicy does not admit the Serve port {SERVE_PORT}: nothing reaches the app")
    operator = allowed.get("operator", set())
    if operator and ray["kind"] != "RayService":
        raise ManifestError(f"{where}: only a RayService needs the KubeRay operator at the dashboard")
    if operator is None or operator - {DASHBOARD_PORT}:
        raise ManifestError(f"{where}: the KubeRay operator may reach the dashboard port {DASHBOARD_PORT} only, "
                            f"admitted {'every port' if operator is None else sorted(operator)}")


# --------------------------------------------------------------------------- all together


def check_kuberay_security(documents: list[dict], where: str) -> None:
    """Every check above on one KubeRay manifest's documents (as the API server stores them)."""
    ray = ray_object(documents)
    policies = [d for d in documents if d.get("kind") == "NetworkPolicy"]
    spec = cluster_spec(ray)
    uid, _ = image_user()
    check_secret_refs_required(spec, where)
    for group, _, pod in pod_groups(spec):
        check_secret_env(pod["containers"][0], f"{where}/{group}/{pod['containers'][0]['name']}")
    check_containers(spec, where, uid)
    check_ray_auth(spec, where)
    if not policies:
        raise ManifestError(f"{where}: no NetworkPolicy next to the {ray['kind']}: every pod in the Kubernetes "
                            "cluster reaches its GCS, dashboard and client ports")
    check_network_policy(ray, policies, where)


# --------------------------------------------------------------------------- ray up

_RAY_COMMAND = re.compile(r"\b(ray start|serve deploy)\b")
TOKEN_FILE = "~/.ray/auth_token"  # where `ray get-auth-token --generate` writes it and Ray reads it


def check_ray_up_auth(config: dict, where: str) -> None:
    """RAY_AUTH_MODE=token wherever a command starts Ray or deploys to it, the operator's token file
    synced to Ray's default token path on every node, and the dashboard on the head's loopback."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in config.get(key) or []:
            if "RAY_AUTH_MODE=disabled" in command:
                raise ManifestError(f"{where}: {key}: {command!r} turns Ray auth off")
            match = _RAY_COMMAND.search(command)
            if match and "RAY_AUTH_MODE=token" not in command[:match.start()]:
                raise ManifestError(f"{where}: {key}: {command!r} runs `{match.group(1)}` without RAY_AUTH_MODE=token")
            if "--head" in command and "ray start" in command and "--dashboard-host=127.0.0.1" not in command:
                raise ManifestError(f"{where}: {key}: the dashboard must listen on the head's loopback "
                                    "(--dashboard-host=127.0.0.1)")
    mounts = config.get("file_mounts") or {}
    home = "/home/ray/" if (config.get("docker") or {}).get("image") else "~/"
    target = TOKEN_FILE.replace("~/", home)
    if mounts.get(target) != TOKEN_FILE:
        raise ManifestError(f"{where}: file_mounts must copy the Ray auth token {TOKEN_FILE} to {target} on every node")
