"""One settings model per service; every field documented; env vars and flags both work."""

from __future__ import annotations

import importlib
import inspect

import pytest
from pydantic import BaseModel

from policyloop.bus.topology import BusLimits
from policyloop.cluster.catalogue import SERVICES
from policyloop.runtime.settings import ServiceSettings, load_settings
from policyloop.state import RedisPool


def settings_model(module: str) -> type[ServiceSettings]:
    mod = importlib.import_module(module + ".service")
    models = [obj for obj in vars(mod).values() if inspect.isclass(obj)
              and issubclass(obj, ServiceSettings) and obj is not ServiceSettings]
    assert len(models) == 1, f"{module} must define exactly one settings model"
    return models[0]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_every_field_is_documented(service) -> None:  # type: ignore[no-untyped-def]
    model = settings_model(service.module)
    for model_cls in (model, BusLimits, RedisPool):
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
    from policyloop.rollout.settings import RolloutSettings

    with pytest.raises(ValueError, match="engine=sglang needs engine_url"):
        load_settings(RolloutSettings, ["--engine", "sglang"]).check_engine()
    with pytest.raises(ValueError, match="colocated needs engine_url"):
        load_settings(RolloutSettings, ["--weight-source", "colocated"]).check_engine()
    load_settings(RolloutSettings, ["--engine", "sglang", "--engine-url", "http://sglang:30000"]).check_engine()
    load_settings(RolloutSettings, []).check_engine()  # embedded: the replica starts its own
    with pytest.raises(ValueError, match="weight_load=tensors needs engine=embedded"):
        load_settings(RolloutSettings, ["--engine", "sglang", "--engine-url", "http://sglang:30000",
                                        "--weight-load", "tensors"]).check_engine()
    load_settings(RolloutSettings, ["--weight-load", "tensors"]).check_engine()
    with pytest.raises(ValueError, match="role=serving needs serve_run"):
        load_settings(RolloutSettings, ["--role", "serving"]).check_engine()
    sglang = ["--engine", "sglang", "--engine-url", "http://sglang:30000"]
    with pytest.raises(ValueError, match="weight_activation=swap needs engine=embedded"):
        load_settings(RolloutSettings, [*sglang, "--weight-activation", "swap"]).check_engine()
    with pytest.raises(ValueError, match="weight_activation=swap needs weight_update_mode=in_place"):
        load_settings(RolloutSettings, ["--weight-activation", "swap", "--weight-update-mode", "abort"]).check_engine()
    # auto: a swap where the engine can stage, SGLang's pause → update → continue elsewhere.
    assert load_settings(RolloutSettings, []).activation == "swap"
    assert load_settings(RolloutSettings, sglang).activation == "pause"
    assert load_settings(RolloutSettings, ["--weight-update-mode", "retract"]).activation == "pause"
    assert load_settings(RolloutSettings, ["--weight-activation", "pause"]).activation == "pause"


def test_the_loss_settings_message_carries_every_setting_of_every_kind() -> None:
    """The loss registry's settings (of all kinds) and loop.proto's LossSettings (what the learner
    advertises and a run names) are the same names, so a new setting cannot travel half; each
    kind's settings make the round trip through the message exactly."""
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.rl.losses import KINDS, loss_settings, named_in, parameters, to_proto

    assert {f.name for f in loop_pb2.LossSettings.DESCRIPTOR.fields} == set(parameters())
    for kind, model in KINDS.items():
        settings = loss_settings(kind=kind, **({"beta": 0.25} if kind == "dro" else {}))
        assert isinstance(settings, model)
        assert loss_settings(**named_in(to_proto(settings))) == settings


def test_the_loop_settings_are_shared_and_checked() -> None:
    from policyloop.contracts.v1 import status_pb2
    from policyloop.learner.settings import LearnerSettings
    from policyloop.rollout.settings import RolloutSettings

    learner = load_settings(LearnerSettings, ["--max-lag", "2", "--groups-per-step", "8"])
    rollout = load_settings(RolloutSettings, ["--max-lag", "1", "--groups-per-step", "8"])
    assert rollout.loop_disagreement(learner.loop_config()) == "max_lag is 2 there, 1 here"
    assert load_settings(RolloutSettings, ["--max-lag", "2", "--groups-per-step", "8"]).loop_disagreement(
        learner.loop_config()) is None
    assert isinstance(learner.loop_config(), status_pb2.LoopConfig)


def test_nested_learner_settings_from_flags_and_env(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from policyloop.learner.settings import LearnerSettings

    monkeypatch.setenv("POLICYLOOP_LOSS__TIS_CAP", "3.5")
    settings = load_settings(LearnerSettings, ["--loss.kind", "gspo", "--optimizer.lr", "3e-5",
                                               "--no-checkpoint.resume"])
    assert (settings.loss.kind, settings.loss.tis_cap, settings.optimizer.lr) == ("gspo", 3.5, 3e-5)
    assert (settings.loss.clip_low, settings.loss.normalization) == (3e-4, "sequence")  # gspo's own defaults
    assert settings.checkpoint.resume is False
    config = settings.trainer_config()
    assert config.loss == settings.loss and config.lr == 3e-5
    # A kind's own setting, by flag; a kind and its required setting, by env (the loss registry's union).
    assert load_settings(LearnerSettings, ["--loss.clip-low", "0.1"]).loss.model_dump()["clip_low"] == 0.1
    monkeypatch.setenv("POLICYLOOP_LOSS__KIND", "dro")
    monkeypatch.setenv("POLICYLOOP_LOSS__BETA", "0.5")
    assert load_settings(LearnerSettings, []).loss.model_dump()["beta"] == 0.5
    monkeypatch.delenv("POLICYLOOP_LOSS__BETA")
    with pytest.raises(ValueError, match="beta"):
        load_settings(LearnerSettings, [])


def test_the_kinds_of_run_a_learner_trains_together() -> None:
    from policyloop.learner.settings import ColocatedSettings, LearnerSettings, TrackerSettings

    assert LearnerSettings().kinds_problem(world_size=2) is None  # the full model shards over ranks
    assert LearnerSettings(lora_runs=True, tinker=True).kinds_problem(world_size=1) is None
    # LoRA runs are each a tracker run of their own (test_adapter_learner.py).
    assert LearnerSettings(full_model=False, lora_runs=True, tracker=TrackerSettings(kind="tensorboard")
                           ).kinds_problem(world_size=1) is None
    for settings, world_size, named in [
            (LearnerSettings(full_model=False), 1, "nothing to train"),
            (LearnerSettings(tinker=True), 2, "one rank"),
            (LearnerSettings(full_model=False, lora_runs=True, colocated=ColocatedSettings(engines=["http://e:1"])), 1,
             "full_model=false takes none")]:
        assert named in (settings.kinds_problem(world_size) or ""), settings


def test_a_replica_samples_a_steps_batch_at_once_unless_told_otherwise() -> None:
    from policyloop.rollout.settings import RolloutSettings

    assert load_settings(RolloutSettings, ["--groups-per-step", "12"]).task_concurrency == 12
    assert load_settings(RolloutSettings, ["--groups-per-step", "12", "--concurrency", "3"]).task_concurrency == 3
    with pytest.raises(ValueError, match="concurrency"):
        load_settings(RolloutSettings, ["--concurrency", "-1"])
