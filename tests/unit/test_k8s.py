"""deploy/k8s runs the same topology as `policyloop up` and compose.yaml, on Kubernetes.

Each overlay is rendered with `kubectl kustomize` and every object is checked against the
Kubernetes JSON schemas of one version (kubernetes-validate ships them: no cluster, no network).
Then the loop's own rules: every catalogue service once, with the catalogue's command and image,
configured only through settings that exist, probed on ports it declares, given time to stop
gracefully, its state on volumes, NATS as a 3-node JetStream cluster. Each overlay is checked as it
is and with the Tinker API (components/tinker: the front, the catalogue's `tinker`, its sampler, and
tinker=true on the one learner); the serving deployment and the other components an overlay may add
are rendered into each overlay. The last test compares the three deployment paths (`policyloop up`,
compose.yaml, the overlays) with each other."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from policyloop.bus.topology import BusLimits
from policyloop.cluster import local
from policyloop.cluster.catalogue import SERVICE_NAMES, SERVICES, ServiceEntry
from policyloop.cluster.local import LocalCluster, ManagedProcess, free_port, service_args
from policyloop.tinker.settings import TinkerSettings
from tests.helpers import setting_field, settings_model, torchrun_args, torchrun_rank_order

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu-local", "gpu")
# The schemas the objects must satisfy (strict: unknown fields are errors). 1.30 is the oldest
# release with every field used (securityContext.appArmorProfile); newer ones accept them too.
KUBERNETES_VERSION = "1.30"
IMAGE_TAGS = {
    "cpu-local": {"policyloop-light": "latest", "policyloop-torch": "latest"},
    "gpu": {"policyloop-light": "latest", "policyloop-torch": "cuda"},
}
# serve() lets a stopping service's body run shutdown_grace_s plus this margin before cancelling it.
SERVE_MARGIN_S = 5.0
NATS_NODES = 3
SGLANG_URL = "http://127.0.0.1:30000"
# The catalogue services that only components/tinker deploys (not the overlays by themselves).
TINKER_SERVICES = {"tinker"}
# Workloads of components that run a catalogue service in a role of their own: named, and scraped,
# after their workload's app.kubernetes.io/component, not the service's.
ROLES = {"tinker-sampler": "rollout", "serving": "rollout"}


# --- rendering and reading the objects ---------------------------------------------------------------

def _kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed (it renders the kustomize overlays; Debian: apt-get install kubectl)")
    return binary


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run([_kubectl(), "kustomize", str(REPO / "deploy" / "k8s" / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(obj for obj in yaml.safe_load_all(result.stdout) if obj)


@functools.cache
def _render_tinker(overlay: str) -> tuple[dict[str, Any], ...]:
    """The overlay with components/tinker listed in it, as docs/kubernetes.md says."""
    with tempfile.TemporaryDirectory() as directory:
        return _render_with_components(overlay, Path(directory), ("tinker",))


def _image(image: str) -> tuple[str, str]:
    """(repository's last path part, tag) of an image reference."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return name.rsplit("/", 1)[-1], tag


def _is_policyloop(container: dict[str, Any]) -> bool:
    return _image(container["image"])[0] in ("policyloop-light", "policyloop-torch")


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity (or a NATS size such as 16Gi) in plain units."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match and match.group(2) in ("", *units), value
    return float(match.group(1)) * units.get(match.group(2), 1)


@dataclass(frozen=True)
class Service:
    """One catalogue service as an overlay runs it: its workload and its policyloop container."""

    entry: ServiceEntry
    workload: dict[str, Any]
    container: dict[str, Any]
    env: dict[str, Any]          # name -> value (str) or valueFrom (dict), envFrom ConfigMaps applied

    @property
    def pod(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]["spec"]

    def setting(self, variable: str) -> Any:
        """The value the service runs with: set here, or the settings model's default."""
        if variable in self.env:
            return self.env[variable]
        field = setting_field(settings_model(self.entry), variable)
        assert field is not None, f"{variable} is no setting of {self.entry.name}"
        return field.get_default(call_default_factory=True)

    def mount_for(self, path: str, container: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
        """The volume mount holding `path` in `container` (default: the service's) and its
        source: a pod volume, or the StatefulSet's volumeClaimTemplate of that name."""
        container = container or self.container
        mounts = [m for m in container.get("volumeMounts", [])
                  if PurePosixPath(path).is_relative_to(PurePosixPath(m["mountPath"]))]
        assert mounts, f"{self.entry.name}: nothing is mounted at {path}"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        volumes = {v["name"]: v for v in self.pod.get("volumes", [])}
        templates = {t["metadata"]["name"]: t for t in self.workload["spec"].get("volumeClaimTemplates", [])}
        source = volumes.get(mount["name"]) or templates.get(mount["name"])
        assert source is not None, f"{self.entry.name}: mount {mount['name']} has no volume"
        return mount, source


@dataclass(frozen=True)
class Rendered:
    overlay: str
    objects: tuple[dict[str, Any], ...]
    tinker: bool = False         # components/tinker listed in the overlay

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] in kinds]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        [obj] = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        return obj

    @property
    def workloads(self) -> list[dict[str, Any]]:
        return self.of_kind("Deployment", "StatefulSet")

    def pod_specs(self) -> list[tuple[str, dict[str, Any]]]:
        return [(f"{w['kind']}/{w['metadata']['name']}", w["spec"]["template"]["spec"])
                for w in self.of_kind("Deployment", "StatefulSet", "Job")]

    def environment(self, container: dict[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for source in container.get("envFrom", []):
            assert "configMapRef" in source, f"{container['name']}: only ConfigMaps are expected in envFrom"
            env.update(self.get("ConfigMap", source["configMapRef"]["name"]).get("data", {}))
        for item in container.get("env", []):
            env[item["name"]] = item["value"] if "value" in item else item["valueFrom"]
        return env

    def service_containers(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(workload, container) for every policyloop container of a long-running workload."""
        return [(w, c) for w in self.workloads for c in w["spec"]["template"]["spec"]["containers"]
                if _is_policyloop(c)]

    @functools.cached_property
    def services(self) -> dict[str, Service]:
        """Every policyloop service the overlay runs, by the name Prometheus scrapes it as (its
        workload's app.kubernetes.io/component): the catalogue service's own, or a role's (ROLES)."""
        found = {}
        for workload, container in self.service_containers():
            where = workload["metadata"]["name"]
            entry = next((e for e in SERVICES if e.name == container["name"]), None)
            assert entry is not None, f"{where}: container {container['name']} is no service"
            name = workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert ROLES.get(name, name) == entry.name, f"{where}: runs {entry.name} as {name}"
            assert name not in found, f"{name} runs in more than one workload"
            found[name] = Service(entry, workload, container, self.environment(container))
        return found

    @property
    def expected_services(self) -> set[str]:
        """The overlay's: the catalogue's but the Tinker front; with components/tinker, the front and its sampler."""
        return set(SERVICE_NAMES) - TINKER_SERVICES | ({*TINKER_SERVICES, "tinker-sampler"} if self.tinker else set())


@pytest.fixture(scope="module", params=[(overlay, tinker) for overlay in OVERLAYS for tinker in (False, True)],
                ids=lambda variant: variant[0] + ("+tinker" if variant[1] else ""))
def rendered(request: pytest.FixtureRequest) -> Rendered:
    overlay, tinker = request.param
    return Rendered(overlay, _render_tinker(overlay) if tinker else _render(overlay), tinker)


# --- Kubernetes accepts every object ----------------------------------------------------------------

def test_every_object_matches_the_kubernetes_schemas(rendered: Rendered) -> None:
    import kubernetes_validate

    assert rendered.objects
    errors = []
    for obj in rendered.objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            errors.append(f"{obj['kind']}/{obj['metadata'].get('name')}: {getattr(exc, 'message', exc)}")
    assert not errors, "\n".join(errors)


def test_every_container_has_requests_and_limits(rendered: Rendered) -> None:
    for where, pod in rendered.pod_specs():
        for container in pod.get("initContainers", []) + pod["containers"]:
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{where}/{container['name']}: {kind}"


# --- the catalogue, once each ----------------------------------------------------------------------------

def test_every_service_runs_once_with_the_catalogue_command(rendered: Rendered) -> None:
    assert set(rendered.services) == rendered.expected_services
    for name, service in rendered.services.items():
        assert service.container["command"] == ["policyloop", *service_args(service.entry)], name
        assert not service.container.get("args"), name


def test_images_carry_torch_exactly_where_the_catalogue_needs_it(rendered: Rendered) -> None:
    for name, service in rendered.services.items():
        repository, _ = _image(service.container["image"])
        assert repository == ("policyloop-torch" if service.entry.needs_torch else "policyloop-light"), name
    tags = IMAGE_TAGS[rendered.overlay]
    for where, pod in rendered.pod_specs():
        for container in pod.get("initContainers", []) + pod["containers"]:
            if _is_policyloop(container):
                repository, tag = _image(container["image"])
                assert tag == tags[repository], f"{where}/{container['name']}: {container['image']}"


@pytest.mark.parametrize("entry", SERVICES, ids=lambda e: e.name)
def test_every_policyloop_variable_is_a_setting(rendered: Rendered, entry: ServiceEntry) -> None:
    instances = {name: service for name, service in rendered.services.items() if service.entry is entry}
    if not instances:  # the Tinker front, only with components/tinker
        assert entry.name in TINKER_SERVICES and not rendered.tinker, entry.name
        return
    model = settings_model(entry)
    for name, service in instances.items():
        variables = [variable for variable in service.env if variable.startswith("POLICYLOOP_")]
        assert variables, name
        unknown = [v for v in variables if setting_field(model, v) is None]
        assert not unknown, f"{name}: {unknown} set no field of {model.__name__}"


# --- health, identity, stopping ----------------------------------------------------------------------

def _probe_port(probe: dict[str, Any]) -> int | str | None:
    for kind in ("httpGet", "tcpSocket", "grpc"):
        if kind in probe:
            return probe[kind]["port"]
    return None  # exec


def _declared(container: dict[str, Any], port: int | str) -> int | None:
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            return declared["containerPort"]
    return None


def test_probes_point_at_ports_the_container_declares(rendered: Rendered) -> None:
    for where, pod in rendered.pod_specs():
        for container in pod["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = _probe_port(container.get(kind) or {})
                if port is not None:
                    assert _declared(container, port), f"{where}/{container['name']} {kind}: port {port} undeclared"


def test_services_are_probed_on_their_health_endpoints(rendered: Rendered) -> None:
    for name, service in rendered.services.items():
        container = service.container
        assert all(container.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")), name
        assert service.setting("POLICYLOOP_HTTP_HOST") == "0.0.0.0", name
        http_port = int(service.setting("POLICYLOOP_HTTP_PORT"))
        ready = container["readinessProbe"]["httpGet"]
        assert ready["path"] == "/healthz" and _declared(container, ready["port"]) == http_port, name
        if service.entry.grpc:
            assert service.setting("POLICYLOOP_GRPC_HOST") == "0.0.0.0", name
            grpc_port = int(service.setting("POLICYLOOP_GRPC_PORT"))
            probed = [container[k]["grpc"]["port"] for k in ("startupProbe", "livenessProbe") if "grpc" in container[k]]
            assert probed and set(probed) == {grpc_port}, f"{name}: gRPC health protocol on {grpc_port}"


def test_pods_give_services_time_to_stop_gracefully(rendered: Rendered) -> None:
    for name, service in rendered.services.items():
        grace = float(service.setting("POLICYLOOP_SHUTDOWN_GRACE_S"))
        assert service.pod.get("terminationGracePeriodSeconds", 30) > grace + SERVE_MARGIN_S, name


def test_each_replica_is_named_after_its_pod(rendered: Rendered) -> None:
    for name, service in rendered.services.items():
        assert service.env["POLICYLOOP_INSTANCE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}, name
        advertised = service.env["POLICYLOOP_ADVERTISE_HOST"]
        if isinstance(advertised, dict):
            assert advertised == {"fieldRef": {"fieldPath": "status.podIP"}}, name
            continue
        # A stable name instead (the publisher: its endpoint outlives the pod in WEIGHTS).
        svc = rendered.get("Service", advertised)
        labels = service.workload["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        grpc_port = int(service.setting("POLICYLOOP_GRPC_PORT"))
        assert grpc_port in {p["port"] for p in svc["spec"]["ports"]}, name


def test_grpc_services_are_reachable_through_a_service(rendered: Rendered) -> None:
    for name, service in rendered.services.items():
        if not service.entry.grpc:
            continue
        svc = rendered.get("Service", name)
        labels = service.workload["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        assert int(service.setting("POLICYLOOP_GRPC_PORT")) in {p["port"] for p in svc["spec"]["ports"]}, name
    assert rendered.services["learner"].setting("POLICYLOOP_PUBLISHER_ENDPOINT") == "publisher:50052"


# --- state on volumes ---------------------------------------------------------------------------------

def _is_claim(source: dict[str, Any]) -> bool:
    return "persistentVolumeClaim" in source or "spec" in source  # a pod volume, or a volumeClaimTemplate


def test_publisher_and_learner_keep_their_state_on_claims(rendered: Rendered) -> None:
    for name, variable in (("publisher", "POLICYLOOP_STORE_DIR"), ("learner", "POLICYLOOP_CHECKPOINT__DIR")):
        service = rendered.services[name]
        path = service.setting(variable)
        mount, source = service.mount_for(str(path))
        assert _is_claim(source) and not mount.get("readOnly"), f"{name}: {variable}={path}"
        workload = service.workload
        # One writer: a StatefulSet of one, or a Deployment of one that never overlaps two pods.
        assert workload["spec"].get("replicas", 1) == 1, name
        if workload["kind"] == "Deployment":
            assert workload["spec"].get("strategy", {}).get("type") == "Recreate", name
        else:
            assert workload["kind"] == "StatefulSet", name


def test_the_base_model_is_read_from_the_models_claim(rendered: Rendered) -> None:
    using = {name: s for name, s in rendered.services.items() if "POLICYLOOP_MODEL_PATH" in s.env}
    tinker = {"tinker", "tinker-sampler"} if rendered.tinker else set()
    assert set(using) == {"gateway", "rollout", "learner", "evaluator"} | tinker
    for name, service in using.items():
        path = service.env["POLICYLOOP_MODEL_PATH"]
        assert path == "/models/base", name
        mount, source = service.mount_for(path)
        assert source.get("persistentVolumeClaim", {}).get("claimName") == "models", name
        assert mount.get("readOnly"), name
    assert rendered.get("PersistentVolumeClaim", "models")


def test_engines_load_versions_from_a_mounted_directory(rendered: Rendered) -> None:
    for name in ("rollout", "evaluator", *(["tinker-sampler"] if rendered.tinker else [])):
        service = rendered.services[name]
        mount, source = service.mount_for(service.env["POLICYLOOP_WEIGHTS_DIR"])
        assert "emptyDir" in source and not mount.get("readOnly"), name


def test_one_evaluator_at_a_time(rendered: Rendered) -> None:
    """A second evaluator would evaluate (and promote) the same versions again."""
    workload = rendered.services["evaluator"].workload
    assert workload["spec"].get("replicas", 1) == 1
    assert workload["kind"] == "Deployment" and workload["spec"]["strategy"]["type"] == "Recreate"


# --- NATS and Redis --------------------------------------------------------------------------------------

def test_nats_is_a_three_node_jetstream_cluster(rendered: Rendered) -> None:
    nats = rendered.get("StatefulSet", "nats")
    assert nats["spec"]["replicas"] == NATS_NODES
    headless = rendered.get("Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"].get("publishNotReadyAddresses")
    assert rendered.get("Service", "nats")["spec"]["ports"]
    pod = nats["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"].startswith("nats:2.9-alpine")
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
    assert env["SERVER_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}

    [config_volume] = [v for v in pod["volumes"] if "configMap" in v]
    [config_mount] = [m for m in container["volumeMounts"] if m["name"] == config_volume["name"]]
    config_map = rendered.get("ConfigMap", config_volume["configMap"]["name"])
    [(file_name, config)] = config_map["data"].items()
    assert f"{config_mount['mountPath']}/{file_name}" in container["args"]
    assert re.search(r"^server_name:\s*\$SERVER_NAME\s*$", config, re.MULTILINE)
    routes = set(re.findall(r"nats://(nats-\d+)\.([\w-]+):6222", config))
    assert routes == {(f"nats-{i}", headless["metadata"]["name"]) for i in range(NATS_NODES)}
    store = re.search(r"store_dir:\s*(\S+)", config).group(1)  # type: ignore[union-attr]
    [data] = nats["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == data["metadata"]["name"] and m["mountPath"] == store for m in container["volumeMounts"])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["path"].startswith("/healthz") and _declared(container, probe["port"]) == 8222, kind

    # JetStream refuses to place a stream whose byte bound exceeds the node's store limit.
    assert re.search(r"max_file_store:\s*\$JS_MAX_FILE_STORE", config)
    store_limit = _quantity(env["JS_MAX_FILE_STORE"])
    assert store_limit <= _quantity(data["spec"]["resources"]["requests"]["storage"])
    urls = [f"nats://nats-{i}.{headless['metadata']['name']}:4222" for i in range(NATS_NODES)]
    for name, service in rendered.services.items():
        assert service.env["POLICYLOOP_NATS_URL"].split(",") == urls, name
        assert int(service.setting("POLICYLOOP_BUS__STREAM_REPLICAS")) == NATS_NODES, name
        trajectories = int(service.env.get("POLICYLOOP_BUS__TRAJECTORY_MAX_BYTES", BusLimits().trajectory_max_bytes))
        assert trajectories < store_limit, name


def test_redis_appends_to_a_claim(rendered: Rendered) -> None:
    redis = rendered.get("StatefulSet", "redis")
    [container] = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:7-alpine")
    command = container["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    [data] = redis["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == data["metadata"]["name"] for m in container["volumeMounts"])
    for name, service in rendered.services.items():
        assert re.fullmatch(r"redis://redis:6379/\d+", service.env["POLICYLOOP_REDIS_URL"]), name
    assert rendered.get("Service", "redis")


# --- Prometheus and Grafana -------------------------------------------------------------------------------

PACKAGE_TELEMETRY = REPO / "libs" / "policyloop" / "telemetry"
K8S_CONFIG = REPO / "deploy" / "k8s" / "base" / "config"
# Kustomize reads nothing outside deploy/k8s: these are copies, which must stay the package's files.
COPIES = {
    "prometheus/alerts.yml": "prometheus/alerts.yml",
    "grafana/datasources.yml": "grafana/provisioning/datasources/policyloop.yml",
    "grafana/dashboards.yml": "grafana/provisioning/dashboards/policyloop.yml",
    "grafana/policyloop.json": "grafana/dashboards/policyloop.json",
}
DISCOVERY = {"file_sd_configs", "kubernetes_sd_configs", "relabel_configs"}


def test_the_observability_files_are_the_packages() -> None:
    for copy, original in COPIES.items():
        assert (K8S_CONFIG / copy).read_bytes() == (PACKAGE_TELEMETRY / original).read_bytes(), (
            f"deploy/k8s/base/config/{copy} differs from libs/policyloop/telemetry/{original}: copy it over")
    # prometheus.yml: the same global settings, rule files and jobs; only how targets are found differs.
    package = yaml.safe_load((PACKAGE_TELEMETRY / "prometheus" / "prometheus.yml").read_text())
    k8s = yaml.safe_load((K8S_CONFIG / "prometheus" / "prometheus.yml").read_text())
    assert set(k8s) == set(package)
    assert {key: value for key, value in k8s.items() if key != "scrape_configs"} == \
        {key: value for key, value in package.items() if key != "scrape_configs"}
    assert [job["job_name"] for job in k8s["scrape_configs"]] == [job["job_name"] for job in package["scrape_configs"]]
    for ours, theirs in zip(k8s["scrape_configs"], package["scrape_configs"], strict=True):
        assert {k: v for k, v in ours.items() if k not in DISCOVERY} == \
            {k: v for k, v in theirs.items() if k not in DISCOVERY}, ours["job_name"]
        assert ours["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"own_namespace": True}}]


def _mounted_configmap(rendered: Rendered, workload: dict[str, Any], path: str) -> dict[str, str]:
    """The data of the ConfigMap mounted at `path` in the workload's one container."""
    pod = workload["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert mount.get("readOnly"), path
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return rendered.get("ConfigMap", volume["configMap"]["name"])["data"]


def _compose_image(name: str) -> tuple[str, list[str] | None]:
    service = yaml.safe_load((REPO / "compose.yaml").read_text())["services"][name]
    default = re.fullmatch(r"\$\{\w+:-([^}]+)\}", service["image"])
    assert default, service["image"]
    return default.group(1), service.get("command")


def test_prometheus_runs_the_shared_configuration_as_compose_does(rendered: Rendered) -> None:
    prometheus = rendered.get("StatefulSet", "prometheus")
    [container] = prometheus["spec"]["template"]["spec"]["containers"]
    image, command = _compose_image("prometheus")
    assert container["image"] == image and container["args"] == command
    data = _mounted_configmap(rendered, prometheus, "/etc/prometheus")
    assert data == {name: (K8S_CONFIG / "prometheus" / name).read_text() for name in ("prometheus.yml", "alerts.yml")}
    [data_claim] = prometheus["spec"]["volumeClaimTemplates"]
    assert any(m["mountPath"] == "/prometheus" and m["name"] == data_claim["metadata"]["name"]
               for m in container["volumeMounts"])


def test_prometheus_may_list_and_watch_the_pods_of_its_namespace(rendered: Rendered) -> None:
    account = rendered.get("StatefulSet", "prometheus")["spec"]["template"]["spec"]["serviceAccountName"]
    assert rendered.get("ServiceAccount", account)
    granted = set()
    for binding in rendered.of_kind("RoleBinding"):
        if {"kind": "ServiceAccount", "name": account, "namespace": "policyloop"} in binding["subjects"]:
            role = rendered.get(binding["roleRef"]["kind"], binding["roleRef"]["name"])
            granted |= {(resource, verb) for rule in role["rules"] if "" in rule["apiGroups"]
                        for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("pods", "list"), ("pods", "watch")} <= granted


def _relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling (keep, drop, replace) of one discovered target; None if dropped."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            result = match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule.get("replacement", "$1")))
            if result:
                labels[rule["target_label"]] = result
            else:
                labels.pop(rule["target_label"], None)
        assert action in ("keep", "drop", "replace"), action
    final = {k: v for k, v in labels.items() if not k.startswith("__") or k == "__address__"}
    final.setdefault("instance", final["__address__"])
    return final


def _discovered(workload: dict[str, Any], pod_name: str, ip: str) -> list[dict[str, str]]:
    """What Prometheus' pod discovery offers for one pod of the workload: a target per declared
    container port, or one without a port for a container declaring none."""
    def sanitized(name: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", name)

    template = workload["spec"]["template"]
    metadata = template["metadata"]
    meta = {"__meta_kubernetes_pod_name": pod_name, "__meta_kubernetes_pod_phase": "Running",
            **{f"__meta_kubernetes_pod_label_{sanitized(k)}": v for k, v in metadata.get("labels", {}).items()},
            **{f"__meta_kubernetes_pod_annotation_{sanitized(k)}": v
               for k, v in metadata.get("annotations", {}).items()}}
    spec = template["spec"]
    targets = []
    for container in spec.get("initContainers", []) + spec["containers"]:
        ports = [p["containerPort"] for p in container.get("ports", [])] or [None]
        targets += [{**meta, "__address__": ip if port is None else f"{ip}:{port}"} for port in ports]
    return targets


def test_every_service_pod_is_scraped_once_with_the_labels_the_rules_use(rendered: Rendered) -> None:
    [job] = yaml.safe_load((K8S_CONFIG / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    services = {id(s.workload): (name, s) for name, s in rendered.services.items()}
    for workload in rendered.of_kind("Deployment", "StatefulSet", "Job"):
        pod_name = f"{workload['metadata']['name']}-0"
        found = {frozenset(t.items()) for t in (_relabel(d, job["relabel_configs"])
                                                 for d in _discovered(workload, pod_name, "10.1.2.3")) if t}
        if id(workload) not in services:  # NATS, Redis, Prometheus, Grafana, the bootstrap Job: not ours to scrape
            assert not found, workload["metadata"]["name"]
            continue
        name, service = services[id(workload)]
        port = int(service.setting("POLICYLOOP_HTTP_PORT"))
        assert [dict(t) for t in found] == [{"__address__": f"10.1.2.3:{port}", "service": name,
                                             "instance": pod_name}], name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_accepts_the_kubernetes_configuration(tmp_path: Path) -> None:
    """Debian's promtool is built without Kubernetes discovery: where it lacks it, the file is
    checked with a static target in its place (everything else: rules, relabelling, globals)."""
    config = yaml.safe_load((K8S_CONFIG / "prometheus" / "prometheus.yml").read_text())
    shutil.copy(K8S_CONFIG / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(["promtool", "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": ["10.1.2.3:9100"]}]
            del job["kubernetes_sd_configs"]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        result = subprocess.run(["promtool", "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisions_what_compose_provisions(rendered: Rendered) -> None:
    grafana = rendered.get("Deployment", "grafana")
    [container] = grafana["spec"]["template"]["spec"]["containers"]
    image, _ = _compose_image("grafana")
    assert container["image"] == image
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["grafana"]
    mounts = {source.removeprefix("./libs/policyloop/telemetry/"): target
              for source, target, *_ in (v.split(":") for v in compose["volumes"] if v.startswith("./"))}
    for source, target in mounts.items():
        data = _mounted_configmap(rendered, grafana, target)
        shipped = PACKAGE_TELEMETRY / source
        assert data == {p.name: p.read_text() for p in shipped.iterdir()}, target
    env = rendered.environment(container)
    for name, value in compose["environment"].items():
        if name != "GF_SECURITY_ADMIN_PASSWORD":
            assert env[name] == value, name
    assert env["GF_SECURITY_ADMIN_PASSWORD"]["secretKeyRef"]["optional"] is True


def test_every_configmap_fits_in_a_client_side_apply_annotation(rendered: Rendered) -> None:
    """`kubectl apply` keeps the whole object in an annotation, at most 256 KiB (the dashboard)."""
    for configmap in rendered.of_kind("ConfigMap"):
        assert len(json.dumps(configmap)) < 256 * 1024 - 4096, configmap["metadata"]["name"]


# --- privileges -------------------------------------------------------------------------------------------

def test_only_the_sandbox_runs_as_root(rendered: Rendered) -> None:
    for name, service in rendered.services.items():
        context = service.container.get("securityContext", {})
        if name == "sandbox":
            # bubblewrap, as compose.yaml gives it: see the comment in deploy/k8s/base/sandbox.yaml.
            assert "SYS_ADMIN" in context["capabilities"]["add"]
            assert context["privileged"] is True  # an unmasked /proc for the jobs' own
            assert context["seccompProfile"]["type"] == "Unconfined"
            assert context["appArmorProfile"]["type"] == "Unconfined"
            continue
        assert context.get("runAsNonRoot") and context.get("allowPrivilegeEscalation") is False, name
        assert context.get("capabilities", {}).get("drop") == ["ALL"], name


# --- per overlay -------------------------------------------------------------------------------------------

def _gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def test_cpu_local_builds_the_model_and_runs_one_replica_each() -> None:
    rendered = Rendered("cpu-local", _render("cpu-local"))
    for where, pod in rendered.pod_specs():
        assert all(_gpus(c) == 0 for c in pod["containers"]), where
    for name, service in rendered.services.items():
        assert service.workload["spec"].get("replicas", 1) == 1, name
    [job] = rendered.of_kind("Job")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["policyloop", "bootstrap", "--out", "/models/cache", "--link", "/models/base"]
    assert _image(container["image"])[0] == "policyloop-torch"
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "models" and not mount.get("readOnly")


def test_gpu_trains_on_a_gpu_and_samples_with_sglang_beside_rollout() -> None:
    rendered = Rendered("gpu", _render("gpu"))
    learner = rendered.services["learner"]
    assert _gpus(learner.container) == 1 and learner.env["POLICYLOOP_DEVICE"] == "cuda"

    rollout = rendered.services["rollout"]
    [sglang] = [c for c in rollout.pod["containers"] if c["name"] == "sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang:")
    command = sglang["command"]
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    for flag, value in (("--model-path", "/models/base"), ("--host", "127.0.0.1"), ("--port", "30000")):
        assert command[command.index(flag) + 1] == value, flag
    assert _gpus(sglang) == 1 and sglang.get("startupProbe")
    _, shm = rollout.mount_for("/dev/shm", sglang)
    assert shm["emptyDir"]["medium"] == "Memory"
    assert _gpus(rollout.container) == 0

    assert rollout.env["POLICYLOOP_ENGINE"] == "sglang"
    assert rollout.env["POLICYLOOP_ENGINE_URL"] == SGLANG_URL
    assert rollout.env["POLICYLOOP_WEIGHT_UPDATE_MODE"] == "in_place"
    # SGLang loads each version from the directory the rollout container writes it to.
    weights_dir = rollout.env["POLICYLOOP_WEIGHTS_DIR"]
    written, source = rollout.mount_for(weights_dir)
    read, same = rollout.mount_for(weights_dir, sglang)
    assert source is same and "emptyDir" in source and written["mountPath"] == read["mountPath"]


# --- the Tinker API: a component an overlay may add -------------------------------------------------------

def _render_with_components(overlay: str, directory: Path, components: tuple[str, ...],
                            patches: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], ...]:
    """The overlay with `components` and `patches` listed in it, as docs/kubernetes.md says (a copy
    of the overlay in `directory`: kustomize takes no absolute paths)."""
    copy = directory / overlay
    shutil.copytree(REPO / "deploy" / "k8s" / "overlays" / overlay, copy)
    k8s = Path(os.path.relpath(REPO / "deploy" / "k8s", copy)).as_posix()
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    kustomization["resources"] = [f"{k8s}/base" if r == "../../base" else r for r in kustomization["resources"]]
    kustomization["components"] = [f"{k8s}/components/{name}" for name in components]
    kustomization["patches"] = kustomization.get("patches", []) + (patches or [])
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run([_kubectl(), "kustomize", str(copy)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(obj for obj in yaml.safe_load_all(result.stdout) if obj)


def _unhashed(obj: dict[str, Any]) -> tuple[str, str]:
    """(kind, name), a generated ConfigMap's name without the hash suffix of its data."""
    name = obj["metadata"]["name"]
    return obj["kind"], re.sub(r"-[a-z0-9]{10}$", "", name) if obj["kind"] == "ConfigMap" else name


def _settings(model: type[Any], env: dict[str, Any]) -> Any:
    """`model` as a process with `env` (its literal POLICYLOOP_* values) loads it."""
    from policyloop.runtime.settings import load_settings

    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("POLICYLOOP_")]:
            patch.delenv(name)
        for name, value in env.items():
            if name.startswith("POLICYLOOP_") and isinstance(value, str):
                patch.setenv(name, value)
        return load_settings(model)


# What the sampler sets over the rollout replicas' settings.
SAMPLER_OWN = {"POLICYLOOP_LORA_RUNS", "POLICYLOOP_TINKER_SAMPLING", "POLICYLOOP_ENGINE", "POLICYLOOP_ENGINE_URL",
               "POLICYLOOP_ENGINE_THREADS"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_tinker_component_adds_the_front_and_the_sampler_and_turns_tinker_on_in_the_one_learner(
        overlay: str) -> None:
    """One switch for the Tinker API: the front (`tinker`: the HTTP API, no engine), tinker-sampler
    (rollout replicas with lora_runs and tinker_sampling, run like the training replicas but each on
    an embedded engine of its own) and tinker=true in the one learner's settings; no second
    learner. The rest of the overlay is left as it was."""
    import kubernetes_validate

    from policyloop.learner.settings import LearnerSettings
    from policyloop.rollout.settings import RolloutSettings

    plain_objects, objects = _render(overlay), _render_tinker(overlay)
    before, after = {_unhashed(o): o for o in plain_objects}, {_unhashed(o): o for o in objects}
    assert len(before) == len(plain_objects) and len(after) == len(objects)
    added = sorted(set(after) - set(before))
    assert added == [("ConfigMap", "policyloop-tinker"), ("ConfigMap", "policyloop-tinker-sampler"),
                     ("Deployment", "tinker"), ("Deployment", "tinker-sampler"), ("Service", "tinker")]
    assert set(before) <= set(after)
    for key in added:
        kubernetes_validate.validate(after[key], KUBERNETES_VERSION, strict=True)
        assert after[key]["metadata"]["namespace"] == "policyloop", key
    # Changed: only the learner's settings (tinker=true), and so the ConfigMap name its pod reads.
    old, new = before[("ConfigMap", "policyloop-learner")], after[("ConfigMap", "policyloop-learner")]
    assert new["data"] == {**old["data"], "POLICYLOOP_TINKER": "true"}
    assert {key for key in before if after[key] != before[key]} == \
        {("ConfigMap", "policyloop-learner"), ("StatefulSet", "learner")}
    renamed = json.dumps(before[("StatefulSet", "learner")]).replace(old["metadata"]["name"], new["metadata"]["name"])
    assert after[("StatefulSet", "learner")] == json.loads(renamed)

    plain, rendered = Rendered(overlay, plain_objects), Rendered(overlay, objects, tinker=True)
    # One learner trains everything: the full model's runs and the Tinker API's models.
    learner = rendered.services["learner"]
    assert [w for w, c in rendered.service_containers() if c["command"] == learner.container["command"]] == \
        [learner.workload]
    assert learner.env == {**plain.services["learner"].env, "POLICYLOOP_TINKER": "true"}
    settings = _settings(LearnerSettings, learner.env)
    assert settings.tinker and settings.full_model and settings.kinds_problem(world_size=1) is None
    # The Tinker models' checkpoints go under its checkpoint directory (tinker/), on its claim.
    mount, source = learner.mount_for(str(settings.checkpoint.dir / "tinker"))
    assert _is_claim(source) and not mount.get("readOnly")

    _check_tinker_front(rendered, plain)

    # The sampler: the training replicas' command, image and settings, and its own switches.
    sampler, rollout = rendered.services["tinker-sampler"], plain.services["rollout"]
    assert sampler.entry is rollout.entry and sampler.workload["kind"] == "Deployment"
    assert sampler.container["command"] == rollout.container["command"]
    assert sampler.container["image"] == rollout.container["image"]
    assert {k: v for k, v in sampler.env.items() if k not in SAMPLER_OWN} == \
        {k: v for k, v in rollout.env.items() if k not in SAMPLER_OWN}
    assert sampler.env["POLICYLOOP_LORA_RUNS"] == sampler.env["POLICYLOOP_TINKER_SAMPLING"] == "true"
    settings = _settings(RolloutSettings, sampler.env)
    settings.check_engine()  # tinker_sampling needs lora_runs, on a training replica
    assert settings.tinker_sampling and settings.lora_runs and settings.role == "training"
    # An embedded engine in its own container, on the CPU (the gpu overlay's SGLang container is
    # the rollout pods' only), sized for the overlay's model.
    assert sampler.env["POLICYLOOP_ENGINE"] == "embedded" and not sampler.env["POLICYLOOP_ENGINE_URL"]
    assert [c["name"] for c in sampler.pod["containers"]] == ["rollout"] and _gpus(sampler.container) == 0
    if overlay == "gpu":  # tinker-sampler-cpu.yaml: the evaluator's room (evaluator-cpu.yaml) and threads
        evaluator = plain.services["evaluator"]
        assert sampler.container["resources"] == evaluator.container["resources"]
        assert sampler.env["POLICYLOOP_ENGINE_THREADS"] == evaluator.env["POLICYLOOP_ENGINE_THREADS"] == "4"
    else:
        assert "POLICYLOOP_ENGINE_THREADS" not in sampler.env
    mount, source = sampler.mount_for(sampler.env["POLICYLOOP_WEIGHTS_DIR"])
    assert "emptyDir" in source and not mount.get("readOnly")


def _check_tinker_front(rendered: Rendered, plain: Rendered) -> None:
    # The front: one replica (it orders each model's requests), the API behind the Service on 8088.
    front = rendered.services["tinker"]
    assert front.workload["kind"] == "Deployment" and front.workload["spec"]["replicas"] == 1
    assert front.container["command"] == ["policyloop", *service_args(front.entry)]
    assert front.env["POLICYLOOP_API_HOST"] == "0.0.0.0"
    svc = rendered.get("Service", "tinker")
    assert svc["spec"]["selector"].items() <= front.workload["spec"]["template"]["metadata"]["labels"].items()
    [exposed] = [p for p in svc["spec"]["ports"] if p["port"] == 8088]
    assert _declared(front.container, exposed["targetPort"]) == int(front.env["POLICYLOOP_API_PORT"])
    assert front.env["POLICYLOOP_API_KEY"]["secretKeyRef"] == \
        {"name": "policyloop-tokens", "key": "tinker-api-key", "optional": True}
    # No engine: nothing of one configured, no publisher to fetch from, smaller than a replica.
    assert not [v for v in front.env if v.startswith(("POLICYLOOP_ENGINE", "POLICYLOOP_PUBLISHER"))]
    assert _gpus(front.container) == 0
    requests, replica = front.container["resources"]["requests"], plain.services["rollout"].container["resources"]
    assert all(_quantity(requests[r]) < _quantity(replica["requests"][r]) for r in ("cpu", "memory"))


# --- the serving deployment: a component an overlay may add --------------------------------------------

SERVING_OWN = {"POLICYLOOP_ROLE", "POLICYLOOP_SERVE_RUN", "POLICYLOOP_OPENAI_HOST", "POLICYLOOP_OPENAI_PORT",
               "POLICYLOOP_ENGINE", "POLICYLOOP_ENGINE_URL"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_serving_component_adds_a_serving_deployment(overlay: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollout replicas with role=serving behind a Service on port 8000: run like the training
    replicas (their settings), each with an embedded engine of its own (the gpu overlay's SGLang
    container is the rollout pods' only); the rest of the overlay is left as it was."""
    import kubernetes_validate

    from policyloop.rollout.settings import RolloutSettings
    from policyloop.runtime.settings import load_settings

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    plain, objects = _render(overlay), _render_with_components(overlay, tmp_path / "default", ("serving",))
    added = [o for o in objects if key(o) not in {key(p) for p in plain}]
    assert sorted(key(o)[0] for o in added) == ["ConfigMap", "Deployment", "Service"]
    # The run it serves, set as docs/kubernetes.md says (the pods roll: the ConfigMap's name changes).
    patch = {"target": {"kind": "ConfigMap", "name": "policyloop-serving"},
             "patch": "- {op: replace, path: /data/POLICYLOOP_SERVE_RUN, value: run-1}"}
    patched = Rendered(overlay, _render_with_components(overlay, tmp_path / "patched", ("serving",), [patch]))
    [patched_container] = patched.get("Deployment", "serving")["spec"]["template"]["spec"]["containers"]
    assert patched.environment(patched_container)["POLICYLOOP_SERVE_RUN"] == "run-1"
    assert patched_container["envFrom"] != \
        Rendered(overlay, objects).get("Deployment", "serving")["spec"]["template"]["spec"]["containers"][0]["envFrom"]
    assert [o for o in objects if o not in added] == list(plain)
    for obj in added:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == "policyloop", key(obj)

    rendered = Rendered(overlay, objects)
    workload = rendered.get("Deployment", "serving")
    [container] = workload["spec"]["template"]["spec"]["containers"]
    rollout = Rendered(overlay, plain).services["rollout"]
    assert container["command"] == rollout.container["command"] == ["policyloop", "serve", "rollout"]
    assert container["image"] == rollout.container["image"]
    env = rendered.environment(container)
    assert {k: v for k, v in env.items() if k not in SERVING_OWN} == \
        {k: v for k, v in rollout.env.items() if k not in SERVING_OWN}
    assert all(setting_field(RolloutSettings, v) is not None for v in env if v.startswith("POLICYLOOP_"))
    assert env["POLICYLOOP_ROLE"] == "serving" and env["POLICYLOOP_SERVE_RUN"]
    assert env["POLICYLOOP_ENGINE"] == "embedded" and not env["POLICYLOOP_ENGINE_URL"]
    assert _gpus(container) == 0 and [c["name"] for c in workload["spec"]["template"]["spec"]["containers"]] == \
        ["rollout"]
    for name, value in env.items():
        if name.startswith("POLICYLOOP_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    load_settings(RolloutSettings).check_engine()  # role=serving with its run, an engine it can start
    # The OpenAI-compatible API: on every interface of the pod, reached through the Service on 8000.
    assert env["POLICYLOOP_OPENAI_HOST"] == "0.0.0.0"
    openai_port = int(env["POLICYLOOP_OPENAI_PORT"])
    svc = rendered.get("Service", "serving")
    assert svc["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    [exposed] = [p for p in svc["spec"]["ports"] if p["port"] == 8000]
    assert _declared(container, exposed["targetPort"]) == openai_port
    serving = Service(rollout.entry, workload, container, env)
    mount, source = serving.mount_for(env["POLICYLOOP_WEIGHTS_DIR"])
    assert "emptyDir" in source and not mount.get("readOnly")
    assert serving.mount_for(env["POLICYLOOP_MODEL_PATH"])[1]["persistentVolumeClaim"]["claimName"] == "models"
    # Scraped once, as the service serving.
    [job] = yaml.safe_load((K8S_CONFIG / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    found = {frozenset(t.items()) for t in (_relabel(d, job["relabel_configs"])
                                             for d in _discovered(workload, "serving-0", "10.1.2.3")) if t}
    assert [dict(t) for t in found] == [{"__address__": "10.1.2.3:9100", "service": "serving",
                                         "instance": "serving-0"}]


# --- a Hugging Face model as the base policy: a component an overlay may add ------------------------------

def test_every_object_is_in_the_policyloop_namespace(rendered: Rendered) -> None:
    """Beside the models claim and each other: an object without one would go to kubectl's namespace."""
    for obj in rendered.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "policyloop", f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_hub_model_component_makes_a_hugging_face_model_the_base_policy(overlay: str, tmp_path: Path) -> None:
    """Its Job, the cluster's models job, downloads the model once into the models volume's
    Hugging Face cache and links /models/base to it (replacing cpu-local's bootstrap Job); the
    services read /models/base as before, and could name the id itself: they read the same cache
    (HF_HOME), offline. The rest of the overlay is left as it was."""
    import kubernetes_validate

    from policyloop.models.resolve import hub_model
    from policyloop.rollout.settings import RolloutSettings

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    plain, objects = _render(overlay), _render_with_components(overlay, tmp_path / "default", ("hub-model",))
    added = [o for o in objects if key(o) not in {key(p) for p in plain}]
    removed = [key(p) for p in plain if key(p) not in {key(o) for o in objects}]
    assert sorted(key(o)[0] for o in added) == ["ConfigMap", "Job"]
    assert removed == ([("Job", "bootstrap-model")] if overlay == "cpu-local" else [])
    assert [o for o in objects if o not in added] == [p for p in plain if key(p) not in removed]
    for obj in added:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == "policyloop", key(obj)

    rendered = Rendered(overlay, objects)
    [job] = rendered.of_kind("Job")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["policyloop", "models", "fetch", "$(BASE_MODEL)", "--link", "/models/base"]
    assert _image(container["image"]) == ("policyloop-light", IMAGE_TAGS[overlay]["policyloop-light"])
    env = rendered.environment(container)
    assert hub_model(env["BASE_MODEL"]) is not None and RolloutSettings(model_path=env["BASE_MODEL"])
    assert env["HF_TOKEN"]["secretKeyRef"]["optional"] is True
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "models" and not mount.get("readOnly")
    assert PurePosixPath(env["HF_HOME"]).is_relative_to("/models") and "HF_HUB_OFFLINE" not in env
    for name, service in rendered.services.items():  # wherever a service reads the model: the same cache
        if "POLICYLOOP_MODEL_PATH" in service.env:
            assert service.env["HF_HOME"] == env["HF_HOME"] and service.env["HF_HUB_OFFLINE"] == "1", name
            assert service.mount_for(env["HF_HOME"])[1]["persistentVolumeClaim"]["claimName"] == "models", name

    # The model, set as the component says (the Job's pod template changes with the ConfigMap's name).
    patch = {"target": {"kind": "ConfigMap", "name": "policyloop-hub-model"},
             "patch": "- {op: replace, path: /data/BASE_MODEL, value: org/model@v1}"}
    patched = Rendered(overlay, _render_with_components(overlay, tmp_path / "patched", ("hub-model",), [patch]))
    [patched_job] = patched.of_kind("Job")
    [patched_container] = patched_job["spec"]["template"]["spec"]["containers"]
    assert patched.environment(patched_container)["BASE_MODEL"] == "org/model@v1"
    assert patched_container["envFrom"] != container["envFrom"]


# --- a multi-node learner: a component an overlay may add ------------------------------------------------

MULTINODE_ADDED = [("Service", "learner-nodes")]
MULTINODE_REMOVED = [("Service", "learner")]
# Changed: the learner's pods, and its claim (ReadWriteMany) but where one machine keeps it ReadWriteOnce.
MULTINODE_CHANGED = {"cpu-local": {("StatefulSet", "learner")},
                     "gpu": {("StatefulSet", "learner"), ("PersistentVolumeClaim", "learner-checkpoints")}}
RENDEZVOUS_PORT = 29400
# How docs/kubernetes.md changes the number of nodes: one patch for replicas and NNODES together.
NODES_PATCH = """\
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: learner}
spec:
  replicas: %d
  template:
    spec:
      containers:
        - name: learner
          env: [{name: NNODES, value: "%d"}]
"""


def _expanded(command: list[str], env: dict[str, str]) -> list[str]:
    """The command as the kubelet runs it: each $(VAR) replaced by the container's variable."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in command]


def _pod_env(rendered: Rendered, workload: dict[str, Any], container: dict[str, Any], pod: str) -> dict[str, str]:
    """The container's variables in pod `pod` of the StatefulSet (the downward API's fields filled in)."""
    fields = {"metadata.name": pod, "metadata.namespace": workload["metadata"]["namespace"]}
    env = {}
    for name, value in rendered.environment(container).items():
        if isinstance(value, dict) and "fieldRef" in value and value["fieldRef"]["fieldPath"] in fields:
            env[name] = fields[value["fieldRef"]["fieldPath"]]
        elif isinstance(value, str):
            env[name] = value
    return env


@contextlib.contextmanager
def _http_status(status: int) -> Iterator[int]:
    """A local HTTP server answering every GET with `status`; yields its port."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the base class's name)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_multinode_learner_component_runs_the_learner_as_torchrun_across_pods(
        overlay: str, tmp_path: Path) -> None:
    """components/multinode-learner: StatefulSet learner of two pods, each a torchrun agent of one
    rank, meeting at a c10d rendezvous on learner-0 through the headless Service learner-nodes
    (which replaces Service learner); the pods keep the learner's settings, image, resources and
    (gpu) GPU, and write into one checkpoint claim, ReadWriteMany (ReadWriteOnce on cpu-local's one
    machine). Rank 0 lands on learner-0, the pod that is probed and scraped; the other pods' probes
    pass without HTTP. The rest of the overlay is left as it was."""
    import kubernetes_validate

    from policyloop.learner.settings import LearnerSettings

    plain, objects = _render(overlay), _render_with_components(overlay, tmp_path / "default", ("multinode-learner",))
    before, after = {_unhashed(o): o for o in plain}, {_unhashed(o): o for o in objects}
    assert sorted(set(after) - set(before)) == MULTINODE_ADDED
    assert sorted(set(before) - set(after)) == MULTINODE_REMOVED
    assert {key for key in set(before) & set(after) if after[key] != before[key]} == MULTINODE_CHANGED[overlay]
    for key in [*MULTINODE_ADDED, *MULTINODE_CHANGED[overlay]]:
        kubernetes_validate.validate(after[key], KUBERNETES_VERSION, strict=True)
        assert after[key]["metadata"]["namespace"] == "policyloop", key
    rendered, base = Rendered(overlay, objects), Rendered(overlay, plain).services["learner"]

    # The pods: every one at once (learner-0 is ready only once all joined), replaced together.
    workload = rendered.get("StatefulSet", "learner")
    spec = workload["spec"]
    nodes = spec["replicas"]
    assert nodes == 2 and spec["podManagementPolicy"] == "Parallel" and spec["updateStrategy"] == {"type": "OnDelete"}
    assert "volumeClaimTemplates" not in spec
    pods = [f"learner-{i}" for i in range(nodes)]
    # Their DNS names, published before they are ready, from the headless Service that governs them.
    service = rendered.get("Service", spec["serviceName"])
    assert service["metadata"]["name"] == "learner-nodes" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    [container] = spec["template"]["spec"]["containers"]
    [rendezvous] = [p for p in service["spec"]["ports"] if p["port"] == RENDEZVOUS_PORT]
    assert _declared(container, rendezvous["targetPort"]) == RENDEZVOUS_PORT
    learner = Service(base.entry, workload, container, rendered.environment(container))

    # The learner's container as the overlay makes it, but for torchrun in front of its command.
    assert {k: v for k, v in container.items() if k not in ("command", "env", "ports") and not k.endswith("Probe")} \
        == {k: v for k, v in base.container.items() if k not in ("command", "env", "ports")
            and not k.endswith("Probe")}
    assert {e["name"]: e for e in base.container["env"]}.items() <= {e["name"]: e for e in container["env"]}.items()
    assert {k: v for k, v in learner.env.items() if k not in ("NNODES", "POD_NAME", "POD_NAMESPACE")} == base.env
    assert learner.pod["terminationGracePeriodSeconds"] == base.pod["terminationGracePeriodSeconds"]
    if overlay == "gpu":
        assert _gpus(container) == 1 and learner.env["POLICYLOOP_DEVICE"] == "cuda"
        assert learner.pod["tolerations"] == base.pod["tolerations"]
    settings = _settings(LearnerSettings, learner.env)
    assert settings.kinds_problem(world_size=nodes) is None
    # The Tinker API and LoRA runs train on one rank (docs/kubernetes.md: not with this component).
    assert "one rank" in str(_settings(LearnerSettings, {**learner.env, "POLICYLOOP_TINKER": "true"})
                             .kinds_problem(world_size=nodes))

    _check_torchrun_commands(rendered, workload, container, service, learner, pods)

    # The checkpoint directory: one claim, written by every pod.
    mount, source = learner.mount_for(str(settings.checkpoint.dir))
    assert source["persistentVolumeClaim"]["claimName"] == "learner-checkpoints" and not mount.get("readOnly")
    claim = rendered.get("PersistentVolumeClaim", "learner-checkpoints")
    assert claim["spec"]["accessModes"] == (["ReadWriteOnce"] if overlay == "cpu-local" else ["ReadWriteMany"])
    assert claim["spec"]["resources"] == before[("PersistentVolumeClaim", "learner-checkpoints")]["spec"]["resources"]

    http_port = _check_multinode_probes(container, base.container, learner, pods, tmp_path)

    # Scraped on learner-0 alone, as the service learner.
    assert _scraped(workload, pods[0]) == [{"__address__": f"10.1.2.3:{http_port}", "service": "learner",
                                            "instance": pods[0]}]
    for pod in pods[1:]:
        assert _scraped(workload, pod) == [], pod

    _check_another_node_count(overlay, tmp_path)

def _check_torchrun_commands(rendered: Rendered, workload: dict[str, Any], container: dict[str, Any],
                             service: dict[str, Any], learner: Service, pods: list[str]) -> None:
    from policyloop.cluster.catalogue import entry as catalogue_entry

    # torchrun, as it parses the command each pod runs: one rank per pod, as many nodes as pods,
    # the rendezvous on learner-0 named through the headless Service, the catalogue's command.
    namespace = workload["metadata"]["namespace"]
    grace = float(learner.setting("POLICYLOOP_SHUTDOWN_GRACE_S"))
    addresses = []
    for pod in pods:
        args = torchrun_args(_expanded(container["command"], _pod_env(rendered, workload, container, pod)))
        assert args.nnodes == str(len(pods)) and args.nproc_per_node == "1", pod
        assert args.rdzv_backend == "c10d" and args.rdzv_id == "policyloop-learner", pod
        assert args.rdzv_endpoint == f"{pods[0]}.{service['metadata']['name']}.{namespace}.svc:{RENDEZVOUS_PORT}", pod
        assert args.local_addr == f"{pod}.{service['metadata']['name']}.{namespace}.svc", pod
        assert args.module and [args.training_script, *args.training_script_args] == \
            ["policyloop", *service_args(catalogue_entry("learner"))], pod
        assert args.max_restarts > 0, pod
        # Rank 0 finishes its step and writes its checkpoint before torchrun kills the ranks,
        # and torchrun before the kubelet does.
        assert grace + SERVE_MARGIN_S < args.shutdown_timeout < learner.pod["terminationGracePeriodSeconds"], pod
        addresses.append(args.local_addr)
    assert torchrun_rank_order(addresses)[0] == addresses[0]  # node 0, rank 0: learner-0
    more = [a.replace("learner-1.", f"learner-{i}.") for i in range(1, 12) for a in addresses[1:2]]
    assert torchrun_rank_order([*more, addresses[0]])[0] == addresses[0]  # learner-10 and on too


def _check_multinode_probes(container: dict[str, Any], base_container: dict[str, Any], learner: Service,
                            pods: list[str], tmp_path: Path) -> int:
    """Returns the learner's HTTP port."""
    # Probes: rank 0's pod on /metrics (startup, liveness) and /healthz (readiness), as the base
    # learner; a follower's pod, which serves nothing, passes. Run here against a local server.
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    paths = {"startupProbe": "/metrics", "livenessProbe": "/metrics", "readinessProbe": "/healthz"}
    assert {kind: base_container[kind]["httpGet"]["path"] for kind in paths} == paths
    http_port = int(learner.setting("POLICYLOOP_HTTP_PORT"))
    assert _declared(container, "http") == http_port

    def probe(kind: str, pod: str, port: int) -> int:
        command = container[kind]["exec"]["command"]
        assert command[-1] == paths[kind], kind
        env = {"PATH": f"{python.parent}:{os.environ['PATH']}", "POD_NAME": pod, "POLICYLOOP_HTTP_PORT": str(port)}
        return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode

    for kind in paths:
        with _http_status(200) as port:
            assert probe(kind, pods[0], port) == 0, kind
        with _http_status(503) as port:
            assert probe(kind, pods[0], port) != 0, kind
            assert probe(kind, pods[1], free_port()) == 0, kind
        assert container[kind]["timeoutSeconds"] >= 3, kind
    return http_port


def _check_another_node_count(overlay: str, tmp_path: Path) -> None:
    # Another number of nodes, as docs/kubernetes.md sets it: replicas and --nnodes together.
    patch = {"target": {"kind": "StatefulSet", "name": "learner"}, "patch": NODES_PATCH % (3, 3)}
    patched = Rendered(overlay, _render_with_components(overlay, tmp_path / "three", ("multinode-learner",), [patch]))
    three = patched.get("StatefulSet", "learner")
    [patched_container] = three["spec"]["template"]["spec"]["containers"]
    args = torchrun_args(_expanded(patched_container["command"],
                                   _pod_env(patched, three, patched_container, "learner-2")))
    assert three["spec"]["replicas"] == 3 and args.nnodes == "3"


# --- three deployment paths, one topology -------------------------------------------------------------

# What `policyloop up` sets that only makes sense for processes on one machine: free ports, the
# process's name and the run directory's name. The thread counts (OMP/MKL) are not settings.
UP_LOCAL_ONLY = {"POLICYLOOP_INSTANCE_ID", "POLICYLOOP_HTTP_PORT", "POLICYLOOP_GRPC_PORT", "POLICYLOOP_RUN_ID"}


def _up_processes(run_dir: Path, **options: Any) -> list[ManagedProcess]:
    """The processes `policyloop up` would start (nothing is started)."""
    def server(name: str) -> Callable[[Path], ManagedProcess]:
        return lambda run_dir: ManagedProcess(name, [name], {}, run_dir / f"{name}.log", {"client": free_port()})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ManagedProcess, "start", lambda self: None)
        patch.setattr(local, "start_nats", server("nats-server"))
        patch.setattr(local, "start_redis", server("redis-server"))
        cluster = LocalCluster(run_dir, extra_env={"POLICYLOOP_MODEL_PATH": "/models/base"},  # as cli.up adds it
                               **options)
        cluster.start()
    return cluster.processes


@pytest.fixture(scope="module")
def up_services(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ManagedProcess]:
    return {p.name.rsplit("-", 1)[0]: p for p in _up_processes(tmp_path_factory.mktemp("up"))}


def test_up_serves_the_tinker_api_on_a_free_port(up_services: dict[str, ManagedProcess]) -> None:
    """Not the default 8088: clusters side by side (tests) each get one; `up` prints it."""
    tinker = up_services["tinker"]
    assert int(tinker.env["POLICYLOOP_API_PORT"]) == tinker.ports["api"] != TinkerSettings().api_port


def test_up_runs_the_tinker_api_on_the_one_learner_and_a_sampling_replica_on_request(tmp_path: Path) -> None:
    """`up --tinker`: the one learner trains the Tinker API's models too (tinker=true), and
    tinker-sampler-0, a rollout replica over the base (lora_runs, tinker_sampling), samples for it;
    without it, neither. No second learner either way."""
    from policyloop.rollout.settings import RolloutSettings
    from policyloop.runtime.settings import load_settings

    plain = {p.name: p for p in _up_processes(tmp_path / "plain")}
    assert not [name for name in plain if name.startswith(local.TINKER_SAMPLER)]
    assert "POLICYLOOP_TINKER" not in plain["learner-0"].env
    processes = {p.name: p for p in _up_processes(tmp_path / "tinker", tinker=True)}
    assert [name for name in processes if local.service_of(name) == "learner"] == ["learner-0"]
    assert processes["learner-0"].env["POLICYLOOP_TINKER"] == "true"
    rollout, sampler = processes["rollout-0"], processes[f"{local.TINKER_SAMPLER}-0"]
    assert local.service_of(sampler.name) == local.TINKER_SAMPLER
    assert sampler.command == rollout.command
    assert sampler.env["POLICYLOOP_LORA_RUNS"] == sampler.env["POLICYLOOP_TINKER_SAMPLING"] == "true"
    assert "POLICYLOOP_TINKER_SAMPLING" not in rollout.env
    for name in ("POLICYLOOP_MODEL_PATH", "POLICYLOOP_NATS_URL", "POLICYLOOP_REDIS_URL"):
        assert sampler.env[name] == rollout.env[name], name
    assert sampler.env["POLICYLOOP_INSTANCE_ID"] == sampler.name and sampler.ports["http"] != rollout.ports["http"]
    with pytest.MonkeyPatch.context() as env:
        for name, value in sampler.env.items():
            if name.startswith("POLICYLOOP_"):
                env.setenv(name, value)
        load_settings(RolloutSettings, []).check_engine()  # a configuration the replica starts with


def test_a_replica_samples_for_the_tinker_api_only_over_the_base() -> None:
    from policyloop.rollout.settings import RolloutSettings

    with pytest.raises(ValueError, match="tinker_sampling needs lora_runs"):
        RolloutSettings(tinker_sampling=True).check_engine()
    RolloutSettings(tinker_sampling=True, lora_runs=True).check_engine()


def test_up_starts_a_serving_replica_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LocalCluster(serving_run=…)`: a rollout process with role=serving serving that run, its
    OpenAI-compatible API on a free port; without it, none."""
    from policyloop.rollout.settings import RolloutSettings
    from policyloop.runtime.settings import load_settings

    assert not [p for p in _up_processes(tmp_path / "plain") if p.name.startswith(local.SERVING)]
    processes = {p.name: p for p in _up_processes(tmp_path / "serving", serving_run="run-1")}
    training, serving = processes["rollout-0"], processes[f"{local.SERVING}-0"]
    assert local.service_of(serving.name) == local.SERVING
    assert serving.command == training.command
    assert serving.env["POLICYLOOP_ROLE"] == "serving" and "POLICYLOOP_ROLE" not in training.env
    assert serving.env["POLICYLOOP_SERVE_RUN"] == "run-1"
    assert int(serving.env["POLICYLOOP_OPENAI_PORT"]) == serving.ports["openai"] != RolloutSettings().openai_port
    for name in ("POLICYLOOP_MODEL_PATH", "POLICYLOOP_WEIGHTS_DIR", "POLICYLOOP_NATS_URL", "POLICYLOOP_REDIS_URL"):
        assert serving.env[name] == training.env[name], name  # versions under each instance's own directory
    assert serving.env["POLICYLOOP_INSTANCE_ID"] == serving.name and serving.ports["http"] != training.ports["http"]
    for name, value in serving.env.items():
        if name.startswith("POLICYLOOP_"):
            monkeypatch.setenv(name, value)
    settings = load_settings(RolloutSettings)
    settings.check_engine()
    assert (settings.role, settings.serve_run, settings.openai_port) == ("serving", "run-1", serving.ports["openai"])


def test_up_gives_the_evaluator_a_weights_directory_of_its_own_which_a_fresh_run_clears(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "evaluator-weights" / "evaluator-0").mkdir(parents=True)
    processes = {p.name: p for p in _up_processes(run_dir, fresh=True)}
    assert not (run_dir / "evaluator-weights").exists()
    evaluator, rollout = processes["evaluator-0"], processes["rollout-0"]
    assert Path(evaluator.env["POLICYLOOP_WEIGHTS_DIR"]) == run_dir.resolve() / "evaluator-weights"
    assert evaluator.env["POLICYLOOP_WEIGHTS_DIR"] != rollout.env["POLICYLOOP_WEIGHTS_DIR"]


def _up_settings(process: ManagedProcess, entry: ServiceEntry) -> set[str]:
    """The settings `up` gives this service that another path must give too. One that `up` sets
    to the model's default may be left out (unset means the same)."""
    model = settings_model(entry)
    required = set()
    for name, value in process.env.items():
        if not name.startswith("POLICYLOOP_") or name in UP_LOCAL_ONLY or os.environ.get(name) == value:
            continue
        field = setting_field(model, name)
        if field is not None and str(field.get_default(call_default_factory=True)) != value:
            required.add(name)
    return required


def _compose_services(*, roles: bool = False) -> dict[str, tuple[list[str], dict[str, str]]]:
    """compose.yaml's catalogue services, with compose.tinker.yaml's (the Tinker front); with
    `roles`, its sampler too (by its own name)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("the docker-compose binary is not installed (it resolves compose.yaml)")
    result = subprocess.run([binary, "-f", "compose.yaml", "-f", "compose.tinker.yaml", "config"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    services = {}
    for name, service in yaml.safe_load(result.stdout)["services"].items():
        command = service.get("command") or []
        if service.get("profiles") or command[:2] != ["policyloop", "serve"] or name in ROLES and not roles:
            continue
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
        key = name if name in ROLES else command[2]
        assert key not in services, f"compose runs {key} twice"
        services[key] = (command, {k: "" if v is None else str(v) for k, v in env.items()})
    return services


def _k8s_services(overlay: str, *, roles: bool = False) -> dict[str, tuple[list[str], dict[str, Any]]]:
    """The overlay's catalogue services, with components/tinker's (the Tinker front); with
    `roles`, its sampler too."""
    rendered = Rendered(overlay, _render_tinker(overlay), tinker=True)
    return {name: (s.container["command"], s.env) for name, s in rendered.services.items()
            if roles or name not in ROLES}


@pytest.mark.parametrize("path", ["compose", *(f"k8s-{o}" for o in OVERLAYS)])
def test_deployment_paths_run_the_same_services_alike(path: str, up_services: dict[str, ManagedProcess]) -> None:
    deployed = _compose_services() if path == "compose" else _k8s_services(path.removeprefix("k8s-"))
    assert set(up_services) == set(deployed) == set(SERVICE_NAMES)
    for entry in SERVICES:
        process = up_services[entry.name]
        command, env = deployed[entry.name]
        assert process.command[1:3] == ["-m", "policyloop"]
        assert command == ["policyloop", *process.command[3:]] == ["policyloop", *service_args(entry)], entry.name
        missing = _up_settings(process, entry) - set(env)
        assert not missing, f"{path}: {entry.name} lacks {sorted(missing)}, which `policyloop up` sets"


@pytest.mark.parametrize("path", ["compose", *(f"k8s-{o}" for o in OVERLAYS)])
def test_deployment_paths_run_the_tinker_api_alike(path: str, tmp_path: Path) -> None:
    """With the Tinker API (`up --tinker`, compose.tinker.yaml, components/tinker): the one
    learner with tinker=true, the sampler with its switches, each given the settings `up` gives
    its process."""
    from policyloop.cluster.catalogue import entry

    up = {local.service_of(p.name): p for p in _up_processes(tmp_path, tinker=True)}
    deployed = _compose_services(roles=True) if path == "compose" else \
        _k8s_services(path.removeprefix("k8s-"), roles=True)
    assert set(up) == set(deployed) == set(SERVICE_NAMES) | {"tinker-sampler"}
    for name in ("learner", "tinker", "tinker-sampler"):
        process, (command, env) = up[name], deployed[name]
        assert command == ["policyloop", *process.command[3:]], name
        missing = _up_settings(process, entry(ROLES.get(name, name))) - set(env)
        assert not missing, f"{path}: {name} lacks {sorted(missing)}, which `policyloop up --tinker` sets"
    assert up["learner"].env["POLICYLOOP_TINKER"] == deployed["learner"][1]["POLICYLOOP_TINKER"] == "true"
    for switch in ("POLICYLOOP_LORA_RUNS", "POLICYLOOP_TINKER_SAMPLING"):
        assert up["tinker-sampler"].env[switch] == deployed["tinker-sampler"][1][switch] == "true", switch


# --- an OpenEnv environment server: a component an overlay may add --------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_openenv_component_runs_an_environment_server_beside_the_cluster(overlay: str, tmp_path: Path) -> None:
    """A Deployment of the image the overlay names for `openenv-env`, probed on OpenEnv's /health,
    behind the Service the submissions name (http://openenv.policyloop:8000); the rest of the
    overlay is left as it was."""
    import kubernetes_validate

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    image = {"name": "openenv-env", "newName": "registry.example.com/envs/echo-env", "newTag": "1.0"}
    copy = tmp_path / "with-image"
    plain = _render(overlay)
    objects = _render_with_components(overlay, copy, ("openenv",))
    added = [o for o in objects if key(o) not in {key(p) for p in plain}]
    assert sorted(key(o) for o in added) == [("Deployment", "openenv"), ("Service", "openenv")]
    assert [o for o in objects if o not in added] == list(plain)
    for obj in added:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == "policyloop", key(obj)
    rendered = Rendered(overlay, objects)
    [container] = rendered.get("Deployment", "openenv")["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {p["containerPort"] for p in container["ports"]} == {8000}
    assert rendered.get("Service", "openenv")["spec"]["ports"][0]["port"] == 8000
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The overlay names the environment's image, as the component's comment says.
    kustomization = copy / overlay / "kustomization.yaml"
    written = yaml.safe_load(kustomization.read_text())
    written["images"] = [*written.get("images", []), image]
    kustomization.write_text(yaml.safe_dump(written))
    result = subprocess.run([_kubectl(), "kustomize", str(copy / overlay)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [deployment] = [o for o in yaml.safe_load_all(result.stdout) if o and key(o) == ("Deployment", "openenv")]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/envs/echo-env:1.0"


# --- a reward model: a component an overlay may add, and its GPU variant ----------------------------------

REWARD_MODEL_LINK = "/models/reward-model"
REWARD_MODEL_ADDED = [("ConfigMap", "policyloop-reward-models"), ("Deployment", "reward-model"),
                      ("Job", "bootstrap-reward-model"), ("Service", "reward-model")]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _scraped(workload: dict[str, Any], pod_name: str) -> list[dict[str, str]]:
    """The targets Prometheus' pod discovery and relabelling make of one pod of the workload."""
    [job] = yaml.safe_load((K8S_CONFIG / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    found = {frozenset(t.items()) for t in (_relabel(d, job["relabel_configs"])
                                             for d in _discovered(workload, pod_name, "10.1.2.3")) if t}
    return [dict(t) for t in found]


@pytest.mark.parametrize("variant", ["cpu-local", "gpu", "gpu+sglang"])
def test_the_reward_model_component_serves_it_to_the_scoring_services(variant: str, tmp_path: Path) -> None:
    """components/reward-model: a Job that builds the bootstrap reward model into the models volume
    and links it at /models/reward-model, an engine serving that link behind the reward-model
    Service (the embedded engine on the CPU; with components/reward-model/gpu, SGLang on a GPU),
    scraped as the service reward-model, and reward and evaluator given its address under the
    model's name, as a setting they load. The rest of the overlay is left as it was."""
    import kubernetes_validate

    from policyloop.cluster.catalogue import entry as catalogue_entry
    from policyloop.cluster.local import REWARD_MODEL_NAME
    from policyloop.evaluation.settings import EvaluatorSettings
    from policyloop.reward.settings import RewardSettings

    overlay, sglang = variant.removesuffix("+sglang"), variant.endswith("+sglang")
    components = ("reward-model", "reward-model/gpu") if sglang else ("reward-model",)
    plain, objects = _render(overlay), _render_with_components(overlay, tmp_path, components)
    before, after = {_unhashed(o): o for o in plain}, {_unhashed(o): o for o in objects}
    assert sorted(set(after) - set(before)) == REWARD_MODEL_ADDED and set(before) <= set(after)
    for key in REWARD_MODEL_ADDED:
        kubernetes_validate.validate(after[key], KUBERNETES_VERSION, strict=True)
        assert after[key]["metadata"]["namespace"] == "policyloop", key
    # Changed: the scoring services' pods, which read the reward models' ConfigMap last.
    changed = {key for key in before if after[key] != before[key]}
    assert changed == {("Deployment", "reward"), ("Deployment", "evaluator")}
    rendered = Rendered(overlay, objects)
    configmap = rendered.get("ConfigMap", after[("ConfigMap", "policyloop-reward-models")]["metadata"]["name"])
    service = rendered.get("Service", "reward-model")
    [port] = service["spec"]["ports"]
    url = f"http://{service['metadata']['name']}:{port['port']}"
    for name, model in (("reward", RewardSettings), ("evaluator", EvaluatorSettings)):
        old, new = before[("Deployment", name)], after[("Deployment", name)]
        [container] = new["spec"]["template"]["spec"]["containers"]
        assert container["name"] == name
        assert container["envFrom"] == [*old["spec"]["template"]["spec"]["containers"][0]["envFrom"],
                                        {"configMapRef": {"name": configmap["metadata"]["name"]}}]
        env = rendered.environment(container)
        assert env["POLICYLOOP_REWARD_MODELS__ENGINES"] == json.dumps({REWARD_MODEL_NAME: [url]}), name
        assert _settings(model, env).reward_models.engines == {REWARD_MODEL_NAME: [url]}, name

    _check_reward_model_job(rendered, overlay)

    # The engine: the link read-only from the models claim, behind the Service, probed on /health.
    workload = rendered.get("Deployment", "reward-model")
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    pod = workload["spec"]["template"]["spec"]
    [engine] = pod["containers"]
    assert [c["name"] for c in pod["initContainers"]] == ["wait-for-model"]
    assert REWARD_MODEL_LINK in " ".join(pod["initContainers"][0]["command"])
    command = engine["command"]
    assert _flag(command, "--model-path") == REWARD_MODEL_LINK and _flag(command, "--host") == "0.0.0.0"
    engine_port = int(_flag(command, "--port"))
    assert _declared(engine, port["targetPort"]) == engine_port
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = engine[kind]["httpGet"]
        assert probe["path"] == "/health" and _declared(engine, probe["port"]) == engine_port, kind
    model = Service(catalogue_entry("reward"), workload, engine, {})
    mount, source = model.mount_for(REWARD_MODEL_LINK)
    assert source["persistentVolumeClaim"]["claimName"] == "models" and mount.get("readOnly")
    for container in pod["initContainers"] + pod["containers"]:
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]) & set(container["resources"]["limits"])
    if sglang:
        assert engine["name"] == "sglang" and engine["image"].startswith("lmsysorg/sglang:")
        assert command[:3] == ["python3", "-m", "sglang.launch_server"]
        assert "--is-embedding" in command and "--enable-metrics" in command
        assert _gpus(engine) == 1 and {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["tolerations"]
    else:
        assert command[:3] == ["python", "-m", "policyloop.engines.embedded"] and _gpus(engine) == 0
        assert _image(engine["image"]) == ("policyloop-torch", IMAGE_TAGS[overlay]["policyloop-torch"])
        context = engine["securityContext"]
        assert context["runAsNonRoot"] and context["allowPrivilegeEscalation"] is False
    # Scraped once, as the service reward-model, on the engine's port (its own /metrics).
    assert _scraped(workload, "reward-model-0") == [{"__address__": f"10.1.2.3:{engine_port}",
                                                     "service": "reward-model", "instance": "reward-model-0"}]


def _check_reward_model_job(rendered: Rendered, overlay: str) -> None:
    # The Job: the bootstrap reward model into the volume's cache, linked where the engine reads it.
    job = rendered.get("Job", "bootstrap-reward-model")
    pod = job["spec"]["template"]["spec"]
    [builder] = pod["containers"]
    assert builder["command"] == ["policyloop", "bootstrap", "--reward-model", "--out", "/models/cache",
                                  "--link", REWARD_MODEL_LINK]
    assert _image(builder["image"]) == ("policyloop-torch", IMAGE_TAGS[overlay]["policyloop-torch"])
    [mount] = [m for m in builder["volumeMounts"] if m["mountPath"] == "/models"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "models" and not mount.get("readOnly")
    assert _scraped(job, "bootstrap-reward-model-0") == []


def _reward_model_up(run_dir: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> LocalCluster:
    """The cluster `policyloop up --reward-model` would start (nothing is started)."""
    def server(name: str) -> Callable[[Path], ManagedProcess]:
        return lambda run_dir: ManagedProcess(name, [name], {}, run_dir / f"{name}.log", {"client": free_port()})

    monkeypatch.setattr(ManagedProcess, "start", lambda self: None)
    monkeypatch.setattr(local, "start_nats", server("nats-server"))
    monkeypatch.setattr(local, "start_redis", server("redis-server"))
    waited: list[str] = []
    monkeypatch.setattr(local, "wait_engine_healthy", lambda managed, timeout_s: waited.append(managed.name))
    cluster = LocalCluster(run_dir, extra_env={"POLICYLOOP_MODEL_PATH": "/models/base"}, **options)
    cluster.start()
    assert waited == ([f"{local.REWARD_MODEL}-0"] if options.get("reward_model") else [])
    return cluster


def test_up_serves_a_reward_model_to_the_scoring_services_on_request(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`LocalCluster(reward_model=DIR)`: reward-model-0, the embedded engine serving DIR on a free
    port, waited for until healthy; reward and evaluator (those scaled up later too) score with it
    under the model's name, as a setting they load; Prometheus scrapes it as the service
    reward-model. Without it, none of this."""
    from policyloop.cluster.prometheus import ScrapeTarget
    from policyloop.evaluation.settings import EvaluatorSettings
    from policyloop.reward.settings import RewardSettings

    variable = "POLICYLOOP_REWARD_MODELS__ENGINES"
    monkeypatch.delenv(variable, raising=False)
    plain = _reward_model_up(tmp_path / "plain", monkeypatch)
    assert not [p for p in plain.processes if local.service_of(p.name) == local.REWARD_MODEL]
    assert not [p.name for p in plain.processes if variable in p.env]

    cluster = _reward_model_up(tmp_path / "rm", monkeypatch, reward_model=Path("/models/rm"))
    processes = {p.name: p for p in cluster.processes}
    engine = processes[f"{local.REWARD_MODEL}-0"]
    assert engine.command[1:3] == ["-m", "policyloop.engines.embedded"]
    assert _flag(engine.command, "--model-path") == "/models/rm"
    port = engine.ports["http"]
    assert int(_flag(engine.command, "--port")) == port and _flag(engine.command, "--host") == "127.0.0.1"
    url = f"http://127.0.0.1:{port}"
    assert {name for name, p in processes.items() if variable in p.env} == {"reward-0", "evaluator-0"}
    for name, model in (("reward-0", RewardSettings), ("evaluator-0", EvaluatorSettings)):
        assert _settings(model, processes[name].env).reward_models.engines == {local.REWARD_MODEL_NAME: [url]}
    assert "POLICYLOOP_PUBLISHER_ENDPOINT" not in engine.env  # an engine, not a service
    assert ScrapeTarget(local.REWARD_MODEL, engine.name, f"127.0.0.1:{port}") in cluster.scrape_targets()
    assert cluster.info().processes[engine.name] == {"http": port}
    cluster.scale("reward", 2)
    [added] = [p for p in cluster.processes if p.name == "reward-1"]
    assert added.env[variable] == processes["reward-0"].env[variable]
    with pytest.raises(ValueError, match="cannot scale"):
        cluster.scale(local.REWARD_MODEL, 2)


@pytest.mark.parametrize("path", ["compose", *(f"k8s-{o}" for o in OVERLAYS)])
def test_deployment_paths_serve_the_reward_model_alike(path: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`up --reward-model`, compose.reward-model.yaml and components/reward-model: the same
    services score with the reward model, under the same name, at the address of the engine each
    deployment runs for it (a compose service, a Kubernetes Service)."""
    variable = "POLICYLOOP_REWARD_MODELS__ENGINES"
    cluster = _reward_model_up(tmp_path / "up", monkeypatch, reward_model=Path("/models/rm"))
    up = {local.service_of(p.name): json.loads(p.env[variable]) for p in cluster.processes if variable in p.env}
    if path == "compose":
        binary = shutil.which("docker-compose")
        if binary is None:
            pytest.skip("the docker-compose binary is not installed (it resolves compose.yaml)")
        result = subprocess.run([binary, "-f", "compose.yaml", "-f", "compose.reward-model.yaml", "config"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        deployed = {name: json.loads(s["environment"][variable]) for name, s in services.items()
                    if variable in (s.get("environment") or {})}
        hosts = set(services)
    else:
        overlay = path.removeprefix("k8s-")
        rendered = Rendered(overlay, _render_with_components(overlay, tmp_path, ("reward-model",)))
        deployed = {w["metadata"]["name"]: json.loads(env[variable]) for w in rendered.workloads
                    for c in w["spec"]["template"]["spec"]["containers"]
                    for env in [rendered.environment(c)] if variable in env}
        hosts = {svc["metadata"]["name"] for svc in rendered.of_kind("Service")}
    assert set(up) == set(deployed) == set(local.SCORING_SERVICES)
    for name in local.SCORING_SERVICES:
        assert list(up[name]) == list(deployed[name]) == [local.REWARD_MODEL_NAME], name
        [address] = deployed[name][local.REWARD_MODEL_NAME]
        host = re.fullmatch(r"http://([\w-]+):\d+", address)
        assert host and host.group(1) == local.REWARD_MODEL and host.group(1) in hosts, address


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_relayed_fanout_component_puts_the_publisher_and_the_replicas_in_a_tree(
        overlay: str, tmp_path: Path) -> None:
    """components/relayed-fanout: the publisher places replicas in a tree of fan-out 4; each rollout
    replica relays on port 50060 of its pod (declared, on every interface, reached at the pod's IP,
    its advertised host) with its node's name as its topology label. Nothing else changes."""
    import kubernetes_validate

    from policyloop.publisher.settings import PublisherSettings
    from policyloop.rollout.settings import RolloutSettings

    plain, objects = _render(overlay), _render_with_components(overlay, tmp_path, ("relayed-fanout",))
    before, after = {_unhashed(o): o for o in plain}, {_unhashed(o): o for o in objects}
    assert set(before) == set(after)
    changed = {key for key in before if after[key] != before[key]}
    assert changed == {("StatefulSet", "publisher"), ("Deployment", "rollout")}
    for key in changed:
        kubernetes_validate.validate(after[key], KUBERNETES_VERSION, strict=True)
    rendered, base = Rendered(overlay, objects), Rendered(overlay, plain)

    publisher = rendered.get("StatefulSet", "publisher")["spec"]["template"]["spec"]["containers"][0]
    tree = _settings(PublisherSettings, rendered.environment(publisher)).tree
    assert (tree.fanout, tree.lease_s) == (4, PublisherSettings().tree.lease_s)

    pod = rendered.get("Deployment", "rollout")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "rollout"]
    env = rendered.environment(container)
    settings = _settings(RolloutSettings, env)
    assert settings.relay.enabled and settings.relay.host == "0.0.0.0"
    assert _declared(container, "relay") == settings.relay.port == 50060
    relay_env = {e["name"]: e for e in container["env"]}
    assert relay_env["POLICYLOOP_RELAY__NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert relay_env["POLICYLOOP_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    base_container = base.services["rollout"].container
    assert {k: v for k, v in container.items() if k not in ("env", "ports")} == \
        {k: v for k, v in base_container.items() if k not in ("env", "ports")}


def test_up_with_relay_fanout_puts_the_publisher_and_the_training_replicas_in_a_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LocalCluster(relay_fanout=k)` (`policyloop up --relay-fanout k`): the publisher's tree of
    fan-out k and every training rollout replica's relay, as settings they load; without it, none."""
    from policyloop.publisher.settings import PublisherSettings
    from policyloop.rollout.settings import RolloutSettings

    plain = _reward_model_up(tmp_path / "plain", monkeypatch)
    assert not [p.name for p in plain.processes if any("RELAY" in k or "TREE" in k for k in p.env)]
    cluster = _reward_model_up(tmp_path / "tree", monkeypatch, relay_fanout=3,
                               replicas={"rollout": 2})
    processes = {p.name: p for p in cluster.processes}
    assert _settings(PublisherSettings, processes["publisher-0"].env).tree.fanout == 3
    for name in ("rollout-0", "rollout-1"):
        relay = _settings(RolloutSettings, processes[name].env).relay
        assert relay.enabled and relay.port == 0 and relay.host == "127.0.0.1"
    assert {name for name, p in processes.items() if "POLICYLOOP_RELAY__ENABLED" in p.env} == {"rollout-0", "rollout-1"}
    with pytest.raises(ValueError, match="relay_fanout"):
        LocalCluster(tmp_path / "bad", relay_fanout=-1)
