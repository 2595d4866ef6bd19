"""One settings model per service; every field documented; env vars and flags both work."""

from __future__ import annotations

import importlib
import inspect

import pytest
from pydantic import BaseModel

from policyloop.bus.topology import BusLimits
from policyloop.cluster.catalogue import SERVICES
from policyloop.runtime.settings import ServiceSettings, load_settings


def settings_model(module: str) -> type[ServiceSettings]:
    mod = importlib.import_module(module + ".service")
    models = [obj for obj in vars(mod).values() if inspect.isclass(obj)
              and issubclass(obj, ServiceSettings) and obj is not ServiceSettings]
    assert len(models) == 1, f"{module} must define exactly one settings model"
    return models[0]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_every_field_is_documented(service) -> None:  # type: ignore[no-untyped-def]
    model = settings_model(service.module)
    for model_cls in (model, BusLimits):
        for name, field in model_cls.model_fields.items():
            assert field.description and len(field.description) > 10, f"{model_cls.__name__}.{name}"


def test_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    rollout = settings_model("policyloop.services.rollout")
    monkeypatch.setenv("POLICYLOOP_CONCURRENCY", "7")
    monkeypatch.setenv("POLICYLOOP_BUS__MAX_DELIVER", "9")
    from_env = load_settings(rollout)
    assert from_env.concurrency == 7 and from_env.bus.max_deliver == 9  # type: ignore[attr-defined]
    from_flags = load_settings(rollout, ["--concurrency", "3", "--nats-url", "nats://h:1"])
    assert from_flags.concurrency == 3 and from_flags.nats_url == "nats://h:1"  # type: ignore[attr-defined]
    assert from_flags.bus.max_deliver == 9  # env still applies to what flags leave alone


def test_bad_values_are_refused() -> None:
    rollout = settings_model("policyloop.services.rollout")
    with pytest.raises((ValueError, SystemExit)):
        load_settings(rollout, ["--concurrency", "many"])


def test_settings_are_plain_models() -> None:
    assert issubclass(BusLimits, BaseModel)


def test_each_service_starts_by_module_and_by_cli_and_documents_its_flags() -> None:
    import subprocess
    import sys

    commands = {}
    for service in SERVICES:
        commands[f"-m {service.module}"] = [sys.executable, "-m", service.module, "--help"]
        commands[f"serve {service.name}"] = [sys.executable, "-m", "policyloop", "serve", service.name, "--help"]
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, c in commands.items()}
    for key, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{key}: {out}"
        assert "--nats-url" in out and "NATS server with JetStream." in out, key
    unknown = subprocess.run([sys.executable, "-m", "policyloop", "serve", "nope"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown service 'nope'" in unknown.stdout


def test_rollout_refuses_engine_settings_that_cannot_work() -> None:
    from policyloop.services.rollout.service import RolloutSettings, check_engine_settings

    with pytest.raises(ValueError, match="engine=sglang needs engine_url"):
        check_engine_settings(load_settings(RolloutSettings, ["--engine", "sglang"]))
    with pytest.raises(ValueError, match="colocated needs engine_url"):
        check_engine_settings(load_settings(RolloutSettings, ["--weight-source", "colocated"]))
    check_engine_settings(load_settings(RolloutSettings, ["--engine", "sglang", "--engine-url", "http://sglang:30000"]))
    check_engine_settings(load_settings(RolloutSettings, []))  # embedded: the replica starts its own
