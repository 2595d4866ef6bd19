"""compose.yaml runs the same topology as `policyloop up`: every catalogue service, started
with the same arguments, wired to NATS and Redis, configured only through settings that exist.
The Tinker API is one switch over it, compose.tinker.yaml: the front (the catalogue's `tinker`),
its sampler, and tinker=true on the one learner. A reward model is another, compose.reward-model.yaml:
its build job and engine, and the scoring services pointed at it. compose.multinode-learner.yaml
runs the learner as two torchrun nodes sharing its checkpoint volume.

The checks read what `docker-compose config` resolves (anchors, merges and defaults applied),
not the raw files; no docker engine is needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from policyloop.cluster.catalogue import SERVICE_NAMES, SERVICES, ServiceEntry
from policyloop.cluster.local import service_args
from tests.helpers import setting_field, settings_model, torchrun_args, torchrun_rank_order

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
TINKER_FILE = REPO / "compose.tinker.yaml"
GPU_FILE = REPO / "compose.gpu.yaml"
REWARD_MODEL_FILE = REPO / "compose.reward-model.yaml"
MULTINODE_LEARNER_FILE = REPO / "compose.multinode-learner.yaml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
# The catalogue services only compose.tinker.yaml runs, and what it adds beside them.
TINKER_SERVICES = {"tinker"}
TINKER_ADDS = {*TINKER_SERVICES, "tinker-sampler"}


def _compose_binary() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("the docker-compose binary is not installed")
    return binary


def _run_config(*files: Path) -> subprocess.CompletedProcess[str]:
    names = [arg for file in files or (COMPOSE_FILE,) for arg in ("-f", file.name)]
    return subprocess.run([_compose_binary(), *names, "config"], cwd=REPO, capture_output=True, text=True, timeout=60)


def _resolved(*files: Path) -> dict[str, Any]:
    result = _run_config(*files)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """compose.yaml alone."""
    return _resolved(COMPOSE_FILE)


@pytest.fixture(scope="module")
def tinker_config() -> dict[str, Any]:
    """compose.yaml with compose.tinker.yaml: every catalogue service."""
    return _resolved(COMPOSE_FILE, TINKER_FILE)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _normalized(service: dict[str, Any]) -> dict[str, Any]:
    """The service with its lists of options (volumes, security_opt, …) in one order: merging
    several files reorders them. Argument lists keep theirs."""
    return {key: sorted(value, key=lambda v: json.dumps(v, sort_keys=True))
            if isinstance(value, list) and key not in ("command", "entrypoint") else value
            for key, value in service.items()}


@pytest.mark.parametrize("files", [(COMPOSE_FILE,), (COMPOSE_FILE, TINKER_FILE), (COMPOSE_FILE, GPU_FILE),
                                   (COMPOSE_FILE, GPU_FILE, TINKER_FILE), (COMPOSE_FILE, REWARD_MODEL_FILE),
                                   (COMPOSE_FILE, GPU_FILE, TINKER_FILE, REWARD_MODEL_FILE),
                                   (COMPOSE_FILE, MULTINODE_LEARNER_FILE),
                                   (COMPOSE_FILE, REWARD_MODEL_FILE, MULTINODE_LEARNER_FILE)],
                         ids=lambda fs: "+".join(f.stem for f in fs))
def test_compose_config_is_valid(files: tuple[Path, ...]) -> None:
    result = _run_config(*files)
    assert result.returncode == 0, result.stderr


GPU_PROFILE = {"sglang", "rollout-sglang"}
OBSERVABILITY_PROFILE = {"prometheus", "grafana"}
SERVING_PROFILE = {"serving"}
OPENENV_PROFILE = {"openenv"}


def test_services_are_the_catalogue_plus_nats_redis_and_the_models_job(config: dict[str, Any],
                                                                      tinker_config: dict[str, Any]) -> None:
    default = {name for name, service in config["services"].items() if not service.get("profiles")}
    assert default == {"nats", "redis", "models", *SERVICE_NAMES} - TINKER_SERVICES
    assert set(config["services"]) - default == (GPU_PROFILE | OBSERVABILITY_PROFILE | SERVING_PROFILE
                                                 | OPENENV_PROFILE)
    # compose.tinker.yaml: the rest of the catalogue and the sampler, started by default.
    assert set(tinker_config["services"]) == set(config["services"]) | TINKER_ADDS
    assert not any(tinker_config["services"][name].get("profiles") for name in TINKER_ADDS)


def test_prometheus_runs_the_shipped_scrape_configuration_against_every_service(config: dict[str, Any]) -> None:
    prometheus = config["services"]["prometheus"]
    assert prometheus["profiles"] == ["observability"]
    binds = [v.split(":") for v in prometheus["volumes"] if v.startswith("/")]  # short form: source:target:mode
    mounts = {Path(source).relative_to(REPO).as_posix(): target for source, target, *_ in binds}
    shipped = "libs/policyloop/telemetry/prometheus"
    assert mounts == {f"{shipped}/prometheus.yml": "/etc/prometheus/prometheus.yml",
                      f"{shipped}/alerts.yml": "/etc/prometheus/alerts.yml",
                      "docker/prometheus/targets": "/etc/prometheus/targets"}
    targets = json.loads((REPO / "docker" / "prometheus" / "targets" / "compose.json").read_text())
    port = {_environment(config["services"][name])["POLICYLOOP_HTTP_PORT"] for name in SERVICE_NAMES
            if name not in TINKER_SERVICES}
    assert port == {"9100"}
    # compose.yaml's services; not compose.tinker.yaml's, whose targets would be down without it.
    assert sorted((t["labels"]["service"], t["targets"][0]) for t in targets) == sorted(
        (name, f"{name}:9100") for name in SERVICE_NAMES if name not in TINKER_SERVICES)


def test_grafana_provisions_the_packaged_dashboard_and_datasource_read_only(config: dict[str, Any]) -> None:
    from policyloop.telemetry.dashboard import DATASOURCE_UID, grafana_dir

    grafana = config["services"]["grafana"]
    assert grafana["profiles"] == ["observability"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"]), "pin an exact release"
    binds = [v.split(":") for v in grafana["volumes"] if v.startswith("/")]  # short form: source:target:mode
    assert all(mode == "ro" for _, _, mode in binds), binds
    mounts = {Path(source).relative_to(REPO).as_posix(): target for source, target, _ in binds}
    shipped = "libs/policyloop/telemetry/grafana"
    provider = yaml.safe_load(grafana_dir().joinpath("provisioning", "dashboards", "policyloop.yml").read_text())
    assert mounts == {f"{shipped}/provisioning/datasources": "/etc/grafana/provisioning/datasources",
                      f"{shipped}/provisioning/dashboards": "/etc/grafana/provisioning/dashboards",
                      f"{shipped}/dashboards": provider["providers"][0]["options"]["path"]}
    # The datasource is compose's Prometheus, under the uid every panel names.
    [datasource] = yaml.safe_load(grafana_dir().joinpath("provisioning", "datasources", "policyloop.yml")
                                  .read_text())["datasources"]
    assert datasource["uid"] == DATASOURCE_UID
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"]).groups()  # type: ignore[union-attr]
    prometheus = config["services"][host]
    assert prometheus["profiles"] == grafana["profiles"] and host in grafana["depends_on"]
    assert not any(arg.startswith("--web.listen-address") for arg in prometheus["command"]) and port == "9090"
    # Viewers need no account; the admin's password comes from the environment; only this host connects.
    env = _environment(grafana)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "GF_SECURITY_ADMIN_PASSWORD: ${GRAFANA_ADMIN_PASSWORD" in COMPOSE_FILE.read_text()
    hosts = [p["host_ip"] if isinstance(p, dict) else p.split(":")[0] for p in grafana["ports"]]  # long or short form
    assert hosts == ["127.0.0.1"], grafana["ports"]


def test_the_models_job_links_the_base_policy_before_anything_loads_it(tinker_config: dict[str, Any]) -> None:
    config = tinker_config  # every service, the Tinker API's too
    models = config["services"]["models"]
    assert models["build"]["target"] == "torch" and models["restart"] == "no"
    command = " ".join(models["command"])
    assert "policyloop bootstrap" in command and "--link /models/base" in command
    for name, service in config["services"].items():
        env = _environment(service)
        if env.get("POLICYLOOP_MODEL_PATH", "").startswith("/models/") or name == "sglang":
            # Directly, or through the SGLang server it drives.
            via = "models" if "models" in service["depends_on"] else "sglang"
            condition = config["services"][via]["depends_on"]["models"]["condition"] if via == "sglang" else \
                service["depends_on"]["models"]["condition"]
            assert condition == "service_completed_successfully", name


def test_the_models_job_fetches_the_hugging_face_model_base_model_names(tinker_config: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    """BASE_MODEL=<org/name[@revision]>: `policyloop models fetch` into the volume's Hugging Face
    cache, linked at /models/base; unset, the bootstrap model, unless /models/base is a directory
    of the user's own. The job's shell command runs here with a `policyloop` that records its
    arguments; the services read the same cache, offline."""
    import os
    import stat

    config = tinker_config  # every service, the Tinker API's too
    models = config["services"]["models"]
    env = _environment(models)
    assert env["BASE_MODEL"] == "" and env["HF_HOME"].startswith("/models/") and env["HF_TOKEN"] == ""
    root = tmp_path / "models"
    root.mkdir()
    script = models["command"][2].replace("$$", "$").replace("/models/", f"{root}/")
    fake = tmp_path / "bin" / "policyloop"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)

    def run(base_model: str) -> list[str]:
        calls = tmp_path / f"calls-{len(list(tmp_path.glob('calls-*')))}"
        calls.touch()
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}",
                                   "BASE_MODEL": base_model, "CALLS": str(calls)})
        assert done.returncode == 0, done.stderr
        return calls.read_text().splitlines()

    assert run("Qwen/Qwen2.5-0.5B-Instruct@main") == \
        [f"models fetch Qwen/Qwen2.5-0.5B-Instruct@main --link {root}/base"]
    assert run("") == [f"bootstrap --out {root}/cache --link {root}/base"]
    (root / "base").mkdir()
    (root / "base" / "config.json").write_text("{}")
    assert run("") == []  # the user's own model directory
    for name, service in config["services"].items():
        if _environment(service).get("POLICYLOOP_MODEL_PATH", "").startswith("/models/"):
            assert _environment(service)["HF_HOME"] == env["HF_HOME"], name
            assert _environment(service)["HF_HUB_OFFLINE"] == "1", name


@pytest.mark.parametrize("file", [COMPOSE_FILE, TINKER_FILE, GPU_FILE, REWARD_MODEL_FILE, MULTINODE_LEARNER_FILE],
                         ids=lambda f: f.name)
def test_every_image_comes_from_a_variable_with_the_official_default(file: Path) -> None:
    images = re.findall(r"^\s*image:\s*(\S+)\s*$", file.read_text(), flags=re.MULTILINE)
    assert images
    for image in images:
        assert re.fullmatch(r"\$\{[A-Z_]+:-[^}]+\}", image), image
    defaults = {re.fullmatch(r"\$\{([A-Z_]+):-([^}]+)\}", i).groups() for i in images}  # type: ignore[union-attr]
    if file == COMPOSE_FILE:
        assert ("NATS_IMAGE", "nats:2.9-alpine") in defaults and ("REDIS_IMAGE", "redis:7-alpine") in defaults


def test_the_sandbox_gets_what_bubblewrap_needs_and_only_it_runs_as_root(tinker_config: dict[str, Any]) -> None:
    for name, service in tinker_config["services"].items():
        if name == "sandbox":
            assert service["user"] == "0:0"
            assert {"SYS_ADMIN", "SYS_PTRACE"} <= set(service["cap_add"])
            assert {"seccomp=unconfined", "systempaths=unconfined"} <= set(service["security_opt"])
        else:
            assert "user" not in service and not service.get("cap_add") and not service.get("privileged"), name


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
def test_service_matches_the_catalogue(tinker_config: dict[str, Any], entry: ServiceEntry) -> None:
    service = tinker_config["services"][entry.name]
    assert service["command"] == ["policyloop", *service_args(entry)]
    build = service["build"]
    assert build["target"] == ("torch" if entry.needs_torch else "light")
    assert service["image"] == ("policyloop-torch:latest" if entry.needs_torch else "policyloop-light:latest")
    assert Path(build.get("dockerfile", "Dockerfile")).as_posix().endswith("docker/Dockerfile")
    depends = service.get("depends_on") or {}
    assert {"nats", "redis"} <= set(depends)
    if isinstance(depends, dict):
        for name in ("nats", "redis"):
            assert depends[name].get("condition") == "service_healthy"
    healthcheck = service.get("healthcheck")
    assert healthcheck and healthcheck.get("test") and not healthcheck.get("disable")


@pytest.mark.parametrize("entry", SERVICES, ids=lambda e: e.name)
def test_service_reaches_nats_and_redis(tinker_config: dict[str, Any], entry: ServiceEntry) -> None:
    env = _environment(tinker_config["services"][entry.name])
    assert re.fullmatch(r"nats://nats(:\d+)?", env["POLICYLOOP_NATS_URL"])
    assert re.fullmatch(r"redis://redis(:\d+)?(/\d+)?", env["POLICYLOOP_REDIS_URL"])


@pytest.mark.parametrize("entry", SERVICES, ids=lambda e: e.name)
def test_every_policyloop_variable_is_a_setting(tinker_config: dict[str, Any], entry: ServiceEntry) -> None:
    model = settings_model(entry)
    env = _environment(tinker_config["services"][entry.name])
    variables = [name for name in env if name.startswith("POLICYLOOP_")]
    assert variables
    for variable in variables:
        assert setting_field(model, variable) is not None, f"{entry.name}: {variable} sets no field of {model.__name__}"


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
    target = learner["environment"]["POLICYLOOP_CHECKPOINT__DIR"]
    mounts = [v if isinstance(v, str) else f"{v.get('source')}:{v.get('target')}" for v in learner["volumes"]]
    assert any(m.split(":")[1] == target for m in mounts), mounts


def test_the_tinker_override_adds_the_front_and_the_sampler_and_turns_tinker_on_in_the_one_learner(
        config: dict[str, Any], tinker_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.tinker.yaml, one switch: the front (`tinker`, no engine), `tinker-sampler` (a
    rollout replica with lora_runs and tinker_sampling, configured as `rollout` is), and tinker=true
    on the one learner, whose checkpoints (the Tinker models' under tinker/) stay on its volume.
    Everything else is compose.yaml's as it was."""
    from policyloop.cluster.catalogue import entry
    from policyloop.learner.settings import LearnerSettings
    from policyloop.rollout.settings import RolloutSettings
    from policyloop.runtime.settings import load_settings

    base, merged = config["services"], tinker_config["services"]
    override = yaml.safe_load(TINKER_FILE.read_text())
    assert set(override["services"]) == {"learner", *TINKER_ADDS}
    assert override["services"]["learner"] == {"environment": {"POLICYLOOP_TINKER": "true"}}
    for name in base:
        if name != "learner":
            assert _normalized(merged[name]) == _normalized(base[name]), name
    assert tinker_config["volumes"] == config["volumes"] and "tinker-checkpoints" not in config["volumes"]
    assert not any("tinker" in (service.get("profiles") or []) for service in merged.values())

    # One learner, trained on the Tinker API's models beside the RL runs.
    learner = merged["learner"]
    learners = [name for name, service in merged.items() if service.get("command") == learner["command"]]
    assert learners == ["learner"] and learner["command"] == ["policyloop", *service_args(entry("learner"))]
    assert {k: v for k, v in _normalized(learner).items() if k != "environment"} == \
        {k: v for k, v in _normalized(base["learner"]).items() if k != "environment"}
    env = _environment(learner)
    assert env == {**_environment(base["learner"]), "POLICYLOOP_TINKER": "true"}
    for name, value in env.items():
        if name.startswith("POLICYLOOP_"):
            monkeypatch.setenv(name, value)
    settings = load_settings(LearnerSettings)
    assert settings.tinker and settings.full_model and settings.kinds_problem(world_size=1) is None

    # The front: the HTTP API on 8088, the model's name and tokenizer, no engine.
    front = merged["tinker"]
    assert front["command"] == ["policyloop", *service_args(entry("tinker"))]
    front_env, shared = _environment(front), _environment(base["reward"])  # reward sets nothing of its own
    own = {"POLICYLOOP_ADVERTISE_HOST", "POLICYLOOP_API_HOST", "POLICYLOOP_API_PORT", "POLICYLOOP_API_KEY",
           "POLICYLOOP_MODEL_PATH"}
    assert {k: v for k, v in front_env.items() if k not in own} == \
        {k: v for k, v in shared.items() if k != "POLICYLOOP_ADVERTISE_HOST"}
    assert front_env["POLICYLOOP_ADVERTISE_HOST"] == "tinker" and front_env["POLICYLOOP_API_HOST"] == "0.0.0.0"
    assert front_env["POLICYLOOP_MODEL_PATH"] == "/models/base"
    assert "POLICYLOOP_API_KEY: ${POLICYLOOP_TINKER_API_KEY:-}" in TINKER_FILE.read_text()
    [port] = front["ports"]
    target = port.split(":")[-1] if isinstance(port, str) else port["target"]
    assert str(target) == front_env["POLICYLOOP_API_PORT"] == "8088"
    assert front["depends_on"] == base["gateway"]["depends_on"]  # NATS, Redis and the models job
    # Otherwise a torch service like the evaluator (the image kept; the front no longer needs torch).
    differ = ("command", "environment", "ports", "healthcheck")
    assert {k: v for k, v in _normalized(front).items() if k not in differ} == \
        {k: v for k, v in _normalized(base["evaluator"]).items() if k not in differ}
    assert front["healthcheck"]["test"] == base["rollout"]["healthcheck"]["test"]

    # The sampler: the rollout service but for its name and the two switches.
    sampler, rollout = merged["tinker-sampler"], base["rollout"]
    assert {k: v for k, v in _normalized(sampler).items() if k != "environment"} == \
        {k: v for k, v in _normalized(rollout).items() if k != "environment"}
    sampler_env = _environment(sampler)
    switches = {"POLICYLOOP_LORA_RUNS": "true", "POLICYLOOP_TINKER_SAMPLING": "true"}
    assert sampler_env == {**_environment(rollout), **switches, "POLICYLOOP_ADVERTISE_HOST": "tinker-sampler"}
    for name in sampler_env:
        if name.startswith("POLICYLOOP_"):
            assert setting_field(RolloutSettings, name) is not None, name
    for name, value in sampler_env.items():
        if name.startswith("POLICYLOOP_"):
            monkeypatch.setenv(name, value)
    settings = load_settings(RolloutSettings)
    settings.check_engine()  # tinker_sampling needs lora_runs, on a training replica
    assert settings.tinker_sampling and settings.lora_runs and settings.role == "training"


COMPOSE_SWITCHES = ("COMPOSE_GPU", "COMPOSE_TINKER", "COMPOSE_REWARD_MODEL", "COMPOSE_MULTINODE_LEARNER")


def _compose_sh(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`docker/compose.sh config` with these switches, against a stand-in `docker` that prints its arguments."""
    import os
    import stat

    fake = tmp_path / "docker"
    fake.write_text('#!/bin/sh\n[ "$1" = info ] && exit 0\n[ "$1 $2" = "compose version" ] && exit 0\n'
                    'echo "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    environ = {k: v for k, v in os.environ.items() if k not in COMPOSE_SWITCHES}
    return subprocess.run([str(REPO / "docker" / "compose.sh"), "config"], capture_output=True, text=True,
                          timeout=30, env={**environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", **env})


def test_compose_sh_adds_the_overrides_it_is_asked_for(tmp_path: Path) -> None:
    """COMPOSE_GPU=1, COMPOSE_TINKER=1, COMPOSE_REWARD_MODEL=1 and COMPOSE_MULTINODE_LEARNER=1:
    docker/compose.sh passes compose.gpu.yaml, compose.tinker.yaml, compose.reward-model.yaml and
    compose.multinode-learner.yaml after compose.yaml (run here against a stand-in `docker`)."""
    def files(**env: str) -> list[str]:
        done = _compose_sh(tmp_path, **env)
        assert done.returncode == 0, done.stderr
        args = done.stdout.split()
        return [args[i + 1] for i, arg in enumerate(args) if arg == "-f"]

    assert files() == [COMPOSE_FILE.name]
    assert files(COMPOSE_TINKER="1") == [COMPOSE_FILE.name, TINKER_FILE.name]
    assert files(COMPOSE_GPU="1", COMPOSE_TINKER="1") == [COMPOSE_FILE.name, GPU_FILE.name, TINKER_FILE.name]
    assert files(COMPOSE_REWARD_MODEL="1") == [COMPOSE_FILE.name, REWARD_MODEL_FILE.name]
    assert files(COMPOSE_GPU="1", COMPOSE_TINKER="1", COMPOSE_REWARD_MODEL="1") == \
        [COMPOSE_FILE.name, GPU_FILE.name, TINKER_FILE.name, REWARD_MODEL_FILE.name]
    assert files(COMPOSE_MULTINODE_LEARNER="1") == [COMPOSE_FILE.name, MULTINODE_LEARNER_FILE.name]
    assert files(COMPOSE_REWARD_MODEL="1", COMPOSE_MULTINODE_LEARNER="1") == \
        [COMPOSE_FILE.name, REWARD_MODEL_FILE.name, MULTINODE_LEARNER_FILE.name]


@pytest.mark.parametrize("other", ["COMPOSE_GPU", "COMPOSE_TINKER"])
def test_compose_sh_refuses_a_multinode_learner_that_could_not_train(other: str, tmp_path: Path) -> None:
    """On the GPU (node 0 alone would get one) or with the Tinker API (it trains on one rank), the
    two-node learner would not train: docker/compose.sh says why and runs nothing."""
    done = _compose_sh(tmp_path, COMPOSE_MULTINODE_LEARNER="1", **{other: "1"})
    assert done.returncode == 2 and not done.stdout
    assert "COMPOSE_MULTINODE_LEARNER" in done.stderr and other in done.stderr


def test_the_serving_profile_adds_a_serving_replica_of_a_runs_promoted_versions(config: dict[str, Any]) -> None:
    """`--profile serving`: a rollout replica with role=serving, started and wired like the
    training replicas, that serves the run POLICYLOOP_SERVE_RUN names on an OpenAI-compatible API
    published on this host only."""
    from policyloop.cluster.catalogue import entry
    from policyloop.rollout.settings import RolloutSettings

    serving, rollout = config["services"]["serving"], config["services"]["rollout"]
    assert serving["profiles"] == ["serving"]
    assert serving["command"] == rollout["command"] == ["policyloop", *service_args(entry("rollout"))]
    assert serving["image"] == rollout["image"] and serving["build"]["target"] == "torch"
    env, training = _environment(serving), _environment(rollout)
    own = {"POLICYLOOP_ROLE", "POLICYLOOP_SERVE_RUN", "POLICYLOOP_OPENAI_HOST", "POLICYLOOP_OPENAI_PORT"}
    assert env["POLICYLOOP_ROLE"] == "serving" and "POLICYLOOP_ROLE" not in training
    assert env["POLICYLOOP_SERVE_RUN"] and "POLICYLOOP_SERVE_RUN: ${POLICYLOOP_SERVE_RUN:-" in COMPOSE_FILE.read_text()
    for variable in env:
        if variable.startswith("POLICYLOOP_"):
            assert setting_field(RolloutSettings, variable) is not None, variable
    assert {k: v for k, v in env.items() if k not in own | {"POLICYLOOP_ADVERTISE_HOST"}} == \
        {k: v for k, v in training.items() if k != "POLICYLOOP_ADVERTISE_HOST"}
    assert serving["depends_on"] == rollout["depends_on"] and serving.get("healthcheck", {}).get("test")
    assert serving["volumes"] == rollout["volumes"]
    # The API listens on every interface of the container, published on 127.0.0.1 only.
    assert env["POLICYLOOP_OPENAI_HOST"] == "0.0.0.0"
    [port] = serving["ports"]
    if isinstance(port, str):  # short form: host_ip:published:target[/protocol]
        host, _, target = port.split("/")[0].split(":")
        port = {"host_ip": host, "target": target}
    assert (port["host_ip"], str(port["target"])) == ("127.0.0.1", env["POLICYLOOP_OPENAI_PORT"]), port


def test_directories_services_write_to_are_the_images_own(tinker_config: dict[str, Any]) -> None:
    """The images make every data directory a service writes to (a named volume takes its
    ownership from the image): without a volume, or before it is first mounted, the unprivileged
    user could not create one under /data."""
    setup = (REPO / "docker" / "os-setup.sh").read_text()
    made = set(re.search(r"^mkdir -p (.+)$", setup, flags=re.MULTILINE).group(1).split())  # type: ignore[union-attr]
    owned = set(re.search(r"^chown policyloop:policyloop (.+)$", setup,  # type: ignore[union-attr]
                          flags=re.MULTILINE).group(1).split())
    written = {(name, env[v]) for name, service in tinker_config["services"].items()
               for env in [_environment(service)]
               for v in ("POLICYLOOP_WEIGHTS_DIR", "POLICYLOOP_STORE_DIR", "POLICYLOOP_CHECKPOINT__DIR") if v in env}
    assert {"evaluator", "rollout", "publisher", "learner", "tinker-sampler"} <= {name for name, _ in written}
    for name, directory in written:
        assert directory in made and directory in owned, f"{name}: {directory} is not made for the policyloop user"


def _stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", DOCKERFILE.read_text(), flags=re.MULTILINE | re.IGNORECASE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_dockerfile_defines_light_and_torch_images() -> None:
    stages = _stages()
    assert {"light", "torch"} <= set(stages)
    for name in ("light", "torch"):
        body = stages[name]
        assert re.search(r"^HEALTHCHECK .*CMD \[\"policyloop\", \"probe\"\]", body, flags=re.MULTILINE), name
        assert re.search(r"^USER policyloop$", body, flags=re.MULTILINE), name
        for label in ("org.opencontainers.image.version", "org.opencontainers.image.revision"):
            assert label in body, (name, label)


def test_dockerfile_bases_and_indexes_are_arguments_with_official_defaults() -> None:
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))
    assert args["BASE_IMAGE"].startswith("python:3.11-slim") and args["TORCH_BASE_IMAGE"].startswith("python:3.11")
    assert args["PIP_INDEX_URL"] == "https://pypi.org/simple"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and args["TORCH_VARIANT"] == "cpu"
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS", text, flags=re.MULTILINE)
    assert re.search(r"^FROM \$\{TORCH_BASE_IMAGE\} AS", text, flags=re.MULTILINE)


def test_the_gpu_override_trains_on_a_gpu_with_the_cuda_image() -> None:
    override = yaml.safe_load(GPU_FILE.read_text())
    assert set(override["services"]) == {"learner", "rollout-sglang"}
    learner = override["services"]["learner"]
    assert learner["image"].endswith(":-policyloop-torch:cuda}")
    assert learner["environment"]["POLICYLOOP_DEVICE"] == "cuda"
    [device] = learner["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"]


def test_the_gpu_and_tinker_overrides_together_train_the_tinker_models_on_the_one_gpu_learner() -> None:
    """Nothing more to combine: the one learner, on its GPU, with tinker=true; the Tinker API's
    services as compose.tinker.yaml makes them."""
    both, tinker = _resolved(COMPOSE_FILE, GPU_FILE, TINKER_FILE), _resolved(COMPOSE_FILE, TINKER_FILE)
    learner = both["services"]["learner"]
    env = _environment(learner)
    assert env["POLICYLOOP_DEVICE"] == "cuda" and env["POLICYLOOP_TINKER"] == "true"
    assert learner["image"] == "policyloop-torch:cuda" and learner["deploy"]["resources"]["reservations"]["devices"]
    for name in TINKER_ADDS:
        assert _normalized(both["services"][name]) == _normalized(tinker["services"][name]), name


def test_the_openenv_profile_starts_an_openenv_server_beside_the_cluster(config: dict[str, Any]) -> None:
    """`--profile openenv`: the image OPENENV_IMAGE names (an environment's `openenv build`),
    checked on OpenEnv's /health, reachable from the rollout replicas as http://openenv:8000."""
    server = config["services"]["openenv"]
    assert server["profiles"] == ["openenv"] and "${OPENENV_IMAGE:-" in COMPOSE_FILE.read_text()
    assert "127.0.0.1:8000/health" in " ".join(server["healthcheck"]["test"])
    assert not server.get("ports")  # the cluster's network only
    assert "--openenv http://openenv:8000" in COMPOSE_FILE.read_text()


# --- a reward model: compose.reward-model.yaml ------------------------------------------------------------

REWARD_MODEL_ADDS = {"reward-model-build", "reward-model", "reward-model-sglang"}
SCORING_SERVICES = {"reward", "evaluator"}


@pytest.fixture(scope="module")
def reward_model_config() -> dict[str, Any]:
    """compose.yaml with compose.reward-model.yaml."""
    return _resolved(COMPOSE_FILE, REWARD_MODEL_FILE)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _volume_targets(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source:target:mode of each short-form volume."""
    return {v.split(":")[1]: v for v in service.get("volumes", [])}


def test_the_reward_model_override_serves_it_and_points_the_scoring_services_at_it(
        config: dict[str, Any], reward_model_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.reward-model.yaml, one switch: a job that builds the bootstrap reward model after
    the models job and links it at /models/reward-model, the embedded engine serving that link on
    the CPU (SGLang's with the gpu profile, under the same host name), and reward and evaluator
    given the engine's address under the model's name, as settings they load. Everything else is
    compose.yaml's as it was."""
    from policyloop.cluster.local import REWARD_MODEL_NAME
    from policyloop.evaluation.settings import EvaluatorSettings
    from policyloop.reward.settings import RewardSettings
    from policyloop.runtime.settings import load_settings

    base, merged = config["services"], reward_model_config["services"]
    assert set(merged) == set(base) | REWARD_MODEL_ADDS
    for name in set(base) - SCORING_SERVICES - {"prometheus"}:
        assert _normalized(merged[name]) == _normalized(base[name]), name
    assert reward_model_config["volumes"] == config["volumes"]

    build = merged["reward-model-build"]
    assert build["command"] == ["policyloop", "bootstrap", "--reward-model", "--out", "/models/cache",
                                "--link", "/models/reward-model"]
    assert build["build"] == merged["rollout"]["build"] and build["image"] == merged["models"]["image"]
    # After the models job: the bootstrap policy it starts from is then in the same cache.
    assert build["depends_on"] == {"models": {"condition": "service_completed_successfully"}}
    assert build["restart"] == "no" and _volume_targets(build)["/models"] == "models:/models:rw"

    engine, sglang = merged["reward-model"], merged["reward-model-sglang"]
    command = engine["command"]
    assert command[:3] == ["python", "-m", "policyloop.engines.embedded"] and not engine.get("profiles")
    assert _flag(command, "--model-path") == "/models/reward-model" and _flag(command, "--host") == "0.0.0.0"
    assert engine["image"] == merged["evaluator"]["image"] and engine["build"] == merged["evaluator"]["build"]
    port = _flag(command, "--port")
    assert f"127.0.0.1:{port}/health" in " ".join(engine["healthcheck"]["test"])
    assert sglang["profiles"] == ["gpu"] and sglang["image"] == base["sglang"]["image"]
    assert sglang["command"][:3] == ["python3", "-m", "sglang.launch_server"] and "--is-embedding" in sglang["command"]
    assert (_flag(sglang["command"], "--model-path"), _flag(sglang["command"], "--port")) == \
        ("/models/reward-model", port)
    assert sglang["networks"]["default"]["aliases"] == ["reward-model"]  # reached where the CPU engine is
    assert sglang["deploy"] == base["sglang"]["deploy"]
    for service in (engine, sglang):
        assert _volume_targets(service)["/models"] == "models:/models:ro"
        assert service["depends_on"] == {"reward-model-build": {"condition": "service_completed_successfully"}}

    # The scoring services: compose.yaml's, plus the engine's address under the model's name.
    url = f"http://reward-model:{port}"
    for name, model in (("reward", RewardSettings), ("evaluator", EvaluatorSettings)):
        env = _environment(merged[name])
        assert env == {**_environment(base[name]),
                       "POLICYLOOP_REWARD_MODELS__ENGINES": json.dumps({REWARD_MODEL_NAME: [url]})}, name
        assert {k: v for k, v in _normalized(merged[name]).items() if k != "environment"} == \
            {k: v for k, v in _normalized(base[name]).items() if k != "environment"}, name
        with monkeypatch.context() as patch:
            for variable, value in env.items():
                if variable.startswith("POLICYLOOP_"):
                    patch.setenv(variable, value)
            assert load_settings(model).reward_models.engines == {REWARD_MODEL_NAME: [url]}, name


def test_the_reward_model_override_has_prometheus_scrape_its_engine_too(config: dict[str, Any],
                                                                        reward_model_config: dict[str, Any]) -> None:
    """Its targets directory replaces compose.json's: the same targets, and the engine's as the
    service reward-model on its port."""
    base, prometheus = config["services"]["prometheus"], reward_model_config["services"]["prometheus"]
    assert {k: v for k, v in prometheus.items() if k != "volumes"} == {k: v for k, v in base.items() if k != "volumes"}
    mounts = {target: source for source, target, *_ in (v.split(":") for v in prometheus["volumes"])}
    assert {t: s for t, s in mounts.items() if t != "/etc/prometheus/targets"} == \
        {target: source for source, target, *_ in (v.split(":") for v in base["volumes"])
         if target != "/etc/prometheus/targets"}
    directory = Path(mounts["/etc/prometheus/targets"])
    assert directory.relative_to(REPO).as_posix() == "docker/prometheus/targets-reward-model"
    assert sorted(p.name for p in directory.iterdir()) == ["compose.json", "reward-model.json"]
    compose_json = REPO / "docker" / "prometheus" / "targets" / "compose.json"
    assert (directory / "compose.json").read_bytes() == compose_json.read_bytes(), "copy compose.json over"
    port = _flag(reward_model_config["services"]["reward-model"]["command"], "--port")
    assert json.loads((directory / "reward-model.json").read_text()) == [
        {"targets": [f"reward-model:{port}"], "labels": {"service": "reward-model", "instance": "reward-model"}}]


def test_the_reward_model_override_copies_compose_yamls_shared_parts() -> None:
    """YAML anchors do not reach across files: the copies must say what compose.yaml says."""
    compose, override = yaml.safe_load(COMPOSE_FILE.read_text()), yaml.safe_load(REWARD_MODEL_FILE.read_text())
    assert override["x-reward-model-build"] == compose["services"]["rollout"]["build"]
    shared = compose["x-policyloop-env"]
    assert override["x-reward-model-env"] == {k: shared[k] for k in override["x-reward-model-env"]}


def test_the_reward_model_override_combines_with_the_gpu_and_tinker_ones() -> None:
    """All four files: each override's services as it makes them alone."""
    every = _resolved(COMPOSE_FILE, GPU_FILE, TINKER_FILE, REWARD_MODEL_FILE)["services"]
    reward_model = _resolved(COMPOSE_FILE, REWARD_MODEL_FILE)["services"]
    tinker = _resolved(COMPOSE_FILE, GPU_FILE, TINKER_FILE)["services"]
    for name in REWARD_MODEL_ADDS | SCORING_SERVICES | {"prometheus"}:
        assert _normalized(every[name]) == _normalized(reward_model[name]), name
    for name in set(tinker) - SCORING_SERVICES - {"prometheus"}:
        assert _normalized(every[name]) == _normalized(tinker[name]), name


# --- the learner as two torchrun nodes: compose.multinode-learner.yaml ------------------------------------

@pytest.fixture(scope="module")
def multinode_config() -> dict[str, Any]:
    return _resolved(COMPOSE_FILE, MULTINODE_LEARNER_FILE)


def _seconds(duration: str) -> float:
    """A compose duration (30s, 1m30s) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_the_multinode_learner_override_runs_the_learner_as_two_torchrun_nodes(
        config: dict[str, Any], multinode_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`learner` (node 0) and `learner-node1`: each a torchrun agent of one rank running the
    catalogue's learner command, agreeing on the number of nodes and the rendezvous (c10d, on
    learner, the node that runs rank 0), with the learner's settings and the one checkpoint volume.
    Rank 0 keeps the base learner's health check; node 1, which serves nothing, has none. Everything
    else is compose.yaml's as it was."""
    from policyloop.cluster.catalogue import entry
    from policyloop.learner.settings import LearnerSettings
    from policyloop.runtime.settings import load_settings

    base, merged = config["services"], multinode_config["services"]
    assert set(merged) == set(base) | {"learner-node1"}
    for name in base:
        if name != "learner":
            assert _normalized(merged[name]) == _normalized(base[name]), name
    assert multinode_config["volumes"] == config["volumes"]
    learner, node1 = merged["learner"], merged["learner-node1"]
    assert {k: v for k, v in _normalized(learner).items() if k != "command"} == \
        {k: v for k, v in _normalized(base["learner"]).items() if k != "command"}
    torchrun = ["python", "-m", "torch.distributed.run"]
    nodes = {name: service for name, service in merged.items() if service.get("command", [])[:3] == torchrun}
    assert list(nodes) == ["learner", "learner-node1"]

    # torchrun, as it parses each node's command.
    grace = float(_environment(learner)["POLICYLOOP_SHUTDOWN_GRACE_S"])
    parsed = {name: torchrun_args(service["command"]) for name, service in nodes.items()}
    for name, args in parsed.items():
        assert args.nnodes == str(len(nodes)) and args.nproc_per_node == "1", name
        assert args.rdzv_backend == "c10d" and args.rdzv_id == "policyloop-learner", name
        assert args.rdzv_endpoint == "learner:29400" and args.local_addr == name, name
        assert args.module and [args.training_script, *args.training_script_args] == \
            ["policyloop", *service_args(entry("learner"))], name
        assert args.max_restarts > 0, name
        # Rank 0 finishes its step and writes the checkpoint before torchrun kills the ranks
        # (serve() gives a stopping service its grace and 5 s to nack), and torchrun before compose.
        assert grace + 5 < args.shutdown_timeout < _seconds(nodes[name]["stop_grace_period"]), name
    # The rendezvous host runs rank 0: the node whose address torchrun ranks first.
    assert torchrun_rank_order([args.local_addr for args in parsed.values()])[0] == "learner"

    # Node 1: the learner's image, settings (its trainer's configuration is rank 0's), volumes.
    for key in ("build", "image", "restart", "stop_grace_period"):
        assert node1[key] == learner[key], key
    assert _environment(node1) == {**_environment(learner), "POLICYLOOP_ADVERTISE_HOST": "learner-node1"}
    assert sorted(node1["volumes"]) == sorted(learner["volumes"])
    target = _environment(learner)["POLICYLOOP_CHECKPOINT__DIR"]
    assert [v for v in node1["volumes"] if v.split(":")[1] == target] == ["checkpoints:/data/checkpoints:rw"]
    for name, value in _environment(learner).items():
        if name.startswith("POLICYLOOP_"):
            monkeypatch.setenv(name, value)
    assert load_settings(LearnerSettings).kinds_problem(world_size=len(nodes)) is None
    # Started with node 0, not after it: compose stops dependents first, and node 1 must outlast
    # rank 0's last checkpoint.
    assert node1["depends_on"] == learner["depends_on"] and "learner" not in node1["depends_on"]
    assert node1["healthcheck"] == {"test": ["NONE"]}
    assert learner["healthcheck"] == base["learner"]["healthcheck"]


def test_the_multinode_learner_override_copies_compose_yamls_shared_parts() -> None:
    """YAML anchors do not reach across files: the copies must say what compose.yaml says."""
    compose, override = yaml.safe_load(COMPOSE_FILE.read_text()), yaml.safe_load(MULTINODE_LEARNER_FILE.read_text())
    learner = compose["services"]["learner"]
    assert override["x-multinode-learner-build"] == learner["build"]
    assert override["x-multinode-learner-env"] == {k: v for k, v in learner["environment"].items()
                                                   if k != "POLICYLOOP_ADVERTISE_HOST"}
    assert override["x-multinode-learner-depends"] == learner["depends_on"]
