"""compose.yaml runs the same topology as `policyloop up`: every catalogue service, started
with the same arguments, wired to NATS and Redis, configured only through settings that exist.

The checks read what `docker-compose config` resolves (anchors, merges and defaults applied),
not the raw file; no docker engine is needed."""

from __future__ import annotations

import importlib
import inspect
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from policyloop.cluster.catalogue import SERVICE_NAMES, SERVICES, ServiceEntry
from policyloop.cluster.local import service_args
from policyloop.runtime.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILE = REPO / "docker" / "Dockerfile"


def _compose_binary() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("the docker-compose binary is not installed")
    return binary


def _run_config() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_compose_binary(), "-f", str(COMPOSE_FILE.name), "config"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    result = _run_config()
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _settings_model(entry: ServiceEntry) -> type[ServiceSettings]:
    module = importlib.import_module(entry.module + ".service")
    models = [obj for obj in vars(module).values()
              if inspect.isclass(obj) and issubclass(obj, ServiceSettings) and obj is not ServiceSettings
              and obj.__module__ == module.__name__]
    assert len(models) == 1, f"{module.__name__} must define exactly one settings model"
    return models[0]


def test_compose_config_is_valid() -> None:
    result = _run_config()
    assert result.returncode == 0, result.stderr


GPU_PROFILE = {"sglang", "rollout-sglang"}


def test_services_are_the_catalogue_plus_nats_and_redis(config: dict[str, Any]) -> None:
    default = {name for name, service in config["services"].items() if not service.get("profiles")}
    assert default == {"nats", "redis", *SERVICE_NAMES}
    assert set(config["services"]) - default == GPU_PROFILE


def test_gpu_profile_drives_sglang_through_a_shared_weights_volume(config: dict[str, Any]) -> None:
    sglang, rollout = config["services"]["sglang"], config["services"]["rollout-sglang"]
    assert all(s["profiles"] == ["gpu"] for s in (sglang, rollout))
    assert "sglang.launch_server" in sglang["command"]
    [device] = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"]
    env = _environment(rollout)
    assert env["POLICYLOOP_ENGINE"] == "sglang" and env["POLICYLOOP_ENGINE_URL"] == "http://sglang:30000"
    assert rollout["command"] == config["services"]["rollout"]["command"]
    # SGLang loads each version from the directory the replica writes it to: the same path in both.
    weights_dir = env["POLICYLOOP_WEIGHTS_DIR"]

    def mounted(service: dict[str, Any]) -> set[str]:
        return {(v if isinstance(v, str) else f"{v.get('source')}:{v.get('target')}").split(":")[1]
                for v in service["volumes"]}

    assert weights_dir in mounted(sglang) and weights_dir in mounted(rollout)
    assert {"nats", "redis", "sglang"} <= set(rollout["depends_on"])


@pytest.mark.parametrize("entry", SERVICES, ids=lambda e: e.name)
def test_service_matches_the_catalogue(config: dict[str, Any], entry: ServiceEntry) -> None:
    service = config["services"][entry.name]
    assert service["command"] == ["policyloop", *service_args(entry)]
    build = service["build"]
    assert build["target"] == ("torch" if entry.needs_torch else "base")
    assert Path(build.get("dockerfile", "Dockerfile")).as_posix().endswith("docker/Dockerfile")
    depends = service.get("depends_on") or {}
    assert {"nats", "redis"} <= set(depends)
    if isinstance(depends, dict):
        for name in ("nats", "redis"):
            assert depends[name].get("condition") == "service_healthy"
    healthcheck = service.get("healthcheck")
    assert healthcheck and healthcheck.get("test") and not healthcheck.get("disable")


@pytest.mark.parametrize("entry", SERVICES, ids=lambda e: e.name)
def test_service_reaches_nats_and_redis(config: dict[str, Any], entry: ServiceEntry) -> None:
    env = _environment(config["services"][entry.name])
    assert re.fullmatch(r"nats://nats(:\d+)?", env["POLICYLOOP_NATS_URL"])
    assert re.fullmatch(r"redis://redis(:\d+)?(/\d+)?", env["POLICYLOOP_REDIS_URL"])


@pytest.mark.parametrize("entry", SERVICES, ids=lambda e: e.name)
def test_every_policyloop_variable_is_a_setting(config: dict[str, Any], entry: ServiceEntry) -> None:
    model = _settings_model(entry)
    env = _environment(config["services"][entry.name])
    variables = [name for name in env if name.startswith("POLICYLOOP_")]
    assert variables
    for variable in variables:
        path = variable.removeprefix("POLICYLOOP_").lower().split("__")
        fields: dict[str, Any] = model.model_fields
        for depth, part in enumerate(path):
            assert part in fields, f"{entry.name}: {variable} sets no field of {model.__name__}"
            annotation = fields[part].annotation
            if depth < len(path) - 1:
                assert inspect.isclass(annotation) and hasattr(annotation, "model_fields"), variable
                fields = annotation.model_fields


def test_nats_runs_jetstream_on_a_volume(config: dict[str, Any]) -> None:
    nats = config["services"]["nats"]
    command = nats["command"]
    command = command.split() if isinstance(command, str) else command
    assert "-js" in command or "--jetstream" in command
    assert nats.get("volumes")
    assert nats.get("healthcheck")


def test_redis_keeps_its_data_on_a_volume(config: dict[str, Any]) -> None:
    redis = config["services"]["redis"]
    assert redis.get("volumes")
    assert redis.get("healthcheck")


def test_learner_checkpoints_on_a_volume(config: dict[str, Any]) -> None:
    learner = config["services"]["learner"]
    target = learner["environment"]["POLICYLOOP_CHECKPOINT_DIR"]
    mounts = [v if isinstance(v, str) else f"{v.get('source')}:{v.get('target')}" for v in learner["volumes"]]
    assert any(m.split(":")[1] == target for m in mounts), mounts


def test_dockerfile_defines_base_and_torch_targets() -> None:
    stages = re.findall(r"^\s*FROM\s+\S+\s+AS\s+(\S+)\s*$", DOCKERFILE.read_text(), flags=re.MULTILINE | re.IGNORECASE)
    assert {"base", "torch"} <= set(stages)
