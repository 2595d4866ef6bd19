"""Experiment trackers (policyloop.learner.tracking), each against its real package and offline:
the learner's steps, the run's configuration and the demo's evaluations are read back with the
backend's own reader (TensorBoard's EventAccumulator, MLflow's client, wandb's offline run
file). A missing backend is refused naming its extra; a tracker that fails or hangs never
reaches the caller."""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from policyloop.contracts.v1 import status_pb2
from policyloop.learner.settings import LearnerSettings, TrackerSettings
from policyloop.learner.tracking import (
    _MODULES,
    EXTRAS,
    BackgroundTracker,
    TrackerUnavailable,
    open_learner_tracker,
    open_tracker,
    run_config,
    step_statistics,
    tracker_run_name,
)
from policyloop.rl.losses import loss_settings
from policyloop.rl.settings import OptimizerSettings
from policyloop.runtime import ServiceCannotStart
from tests.helpers import scored_group

SECRET = "s3cret-bearer"
# What the learner exports of each step above: its reward and gradient norm, the loss's statistics.
EXPORTED = ("mean_reward", "grad_norm", "loss", "clip_fraction", "kl_behaviour", "entropy")


def learner_settings(tmp_path: Path, kind: str, **tracker: object) -> LearnerSettings:
    return LearnerSettings(run_id="r7", publisher_token=SECRET, groups_per_step=4, loss=loss_settings(kind="gspo"),
                           optimizer=OptimizerSettings(lr=3e-5), device="cpu",
                           tracker=TrackerSettings(kind=kind, dir=tmp_path / "tracking", **tracker))  # type: ignore[arg-type]


def write_run(settings: LearnerSettings) -> None:
    """Three learner steps (the third's samples one version behind) through the learner's
    tracker, and the demo's evaluations before and after them beside it."""
    from policyloop.rl.trainer import StepReport

    status = status_pb2.LearnerStatus()
    learner = open_learner_tracker(settings)
    evaluation = open_tracker(settings.tracker, run_name=tracker_run_name(settings), role="evaluation")
    evaluation.log_evaluation(0, {"heldout_accuracy": 0.25})
    for step in (1, 2, 3):
        status.trained_samples += 2
        report = StepReport(step=step, samples=2, groups=1, mean_reward=0.25 * step, grad_norm=0.5, trained_tokens=4,
                            seconds=0.2, statistics={"loss": 1.0 / step, "clip_fraction": 0.1, "kl_behaviour": 0.01,
                                                     "entropy": 1.5})
        samples = scored_group(f"t{step}", version=1 if step == 3 else step - 1)
        learner.log_step(step, step_statistics(report, 0.5, samples, step - 1, status))
    evaluation.log_evaluation(3, {"heldout_accuracy": 0.5})
    learner.close()
    evaluation.close()
    assert getattr(learner, "failed", None) is None and getattr(evaluation, "failed", None) is None


def assert_no_secret(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_the_run_configuration_is_flat_without_plumbing_or_secrets(tmp_path: Path) -> None:
    config = run_config(learner_settings(tmp_path, "none"))
    assert config["loss.kind"] == "gspo" and config["optimizer.lr"] == 3e-5 and config["groups_per_step"] == 4
    assert config["run_id"] == "r7" and config["model"] == "policy" and config["max_lag"] == 1
    assert config["checkpoint.every"] == 50 and config["tracker.kind"] == "none"
    assert config["colocated.engines"] == "[]"  # lists as JSON
    assert "publisher_token" not in config and SECRET not in json.dumps(config)
    assert not {"nats_url", "redis_url", "http_port", "instance_id"} & set(config)
    assert not [name for name in config if name.startswith("bus.")]
    assert all(isinstance(value, str | int | float | bool) for value in config.values())


def test_tensorboard_holds_the_steps_the_evaluations_and_the_configuration(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    write_run(learner_settings(tmp_path, "tensorboard"))
    run = tmp_path / "tracking" / "tensorboard" / "r7"
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [e.value for e in events.Scalars("train/mean_reward")] == [0.25, 0.5, 0.75]
    assert [e.value for e in events.Scalars("train/version")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("train/lag_max")] == [0, 0, 1]
    assert [e.value for e in events.Scalars("train/trained_samples_total")] == [2, 4, 6]
    assert {f"train/{name}" for name in EXPORTED} <= set(events.Tags()["scalars"])
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["loss.kind"].string_value == "gspo" and hparams["optimizer.lr"].number_value == 3e-5
    assert hparams["run_id"].string_value == "r7" and "publisher_token" not in hparams
    [table] = events.Tensors("config/text_summary")
    assert "| loss.kind | gspo |" in table.tensor_proto.string_val[0].decode()
    # The demo's evaluations: their own TensorBoard run beside the learner's, at the learner's steps.
    evaluation = EventAccumulator(str(run / "evaluation"))
    evaluation.Reload()
    assert [(e.step, e.value) for e in evaluation.Scalars("eval/heldout_accuracy")] == [(0, 0.25), (3, 0.5)]
    assert_no_secret(tmp_path / "tracking")


def wandb_records(path: Path) -> Iterator[object]:
    """The records of a wandb run file (run-<id>.wandb): wandb's protobuf Records in LevelDB's log
    format — a 7-byte header (':W&B', magic 0xBEE1, version), then 32 KiB blocks of chunks, each
    with a 7-byte header (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 or position + 7 + length > len(data):  # the end, or a chunk still being written
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def finished_wandb_records(path: Path, timeout_s: float = 120.0) -> list[object]:
    """The records of a finished wandb run file. finish() returns once wandb's service has the run's
    exit, but its buffered writer reaches the file when the service closes the stream, a moment
    later (on a busy machine, after the test had read an empty file): wait for the exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(path))
        kinds = [r.WhichOneof("record_type") for r in records]  # type: ignore[attr-defined]
        if "exit" in kinds:
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s: {kinds}"
        time.sleep(0.1)


def test_wandb_offline_holds_the_steps_the_evaluations_and_the_configuration(tmp_path: Path) -> None:
    write_run(learner_settings(tmp_path, "wandb", wandb_mode="offline"))
    runs = {}
    for path in (tmp_path / "tracking" / "wandb").glob("offline-run-*/run-*.wandb"):
        records = finished_wandb_records(path)
        [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]  # type: ignore[attr-defined]
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        config |= {item.key: json.loads(item.value_json) for r in records
                   if r.WhichOneof("record_type") == "config" for item in r.config.update}  # type: ignore[attr-defined]
        rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                for r in records if r.WhichOneof("record_type") == "history"]  # type: ignore[attr-defined]
        runs[run.job_type] = (run, config, rows)
    assert set(runs) == {"learner", "evaluation"}
    run, config, rows = runs["learner"]
    assert (run.display_name, run.run_group, run.project) == ("r7", "r7", "policyloop")
    assert config["loss.kind"] == "gspo" and config["optimizer.lr"] == 3e-5 and "publisher_token" not in config
    steps = [row for row in rows if "train/step" in row]
    assert [(row["train/step"], row["train/loss"]) for row in steps] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [row["train/lag_max"] for row in steps] == [0, 0, 1]
    assert all(f"train/{name}" in steps[0] for name in EXPORTED)
    run, _, rows = runs["evaluation"]
    assert (run.display_name, run.run_group) == ("r7-evaluation", "r7")  # beside the learner's, in its group
    assert [(row["eval/step"], row["eval/heldout_accuracy"]) for row in rows if "eval/step" in row] == \
        [(0, 0.25), (3, 0.5)]
    assert_no_secret(tmp_path / "tracking")


def test_mlflow_holds_the_steps_the_evaluations_and_the_configuration(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    settings = learner_settings(tmp_path, "mlflow")
    write_run(settings)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("policyloop")
    assert experiment is not None

    def runs() -> dict[str, object]:
        return {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}

    learner = runs()["r7"]
    assert learner.info.status == "FINISHED" and learner.data.tags["policyloop.role"] == "learner"  # type: ignore[attr-defined]
    params = learner.data.params  # type: ignore[attr-defined]
    assert params["loss.kind"] == "gspo" and params["optimizer.lr"] == "3e-05" and "publisher_token" not in params

    def history(run: object, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]  # type: ignore[attr-defined]

    assert history(learner, "train/loss") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert history(learner, "train/lag_max") == [(1, 0), (2, 0), (3, 1)]
    assert history(runs()["r7-evaluation"], "eval/heldout_accuracy") == [(0, 0.25), (3, 0.5)]
    # A learner that restarts continues its run; a setting it changed keeps its first value there.
    with capture_logs() as logs:
        again = open_learner_tracker(settings.model_copy(update={"optimizer": OptimizerSettings(lr=1e-5)}))
        again.log_step(4, {"loss": 0.2})
        again.close()
    assert set(runs()) == {"r7", "r7-evaluation"}
    assert history(runs()["r7"], "train/loss")[-1] == (4, 0.2)
    assert runs()["r7"].data.params["optimizer.lr"] == "3e-05"  # type: ignore[attr-defined]
    assert [e["settings"] for e in logs if e["event"] == "tracker_config_changed"] == [["optimizer.lr"]]
    assert_no_secret(tmp_path / "tracking")


def test_a_tracker_whose_store_breaks_is_turned_off_without_raising(tmp_path: Path) -> None:
    """MLflow's store becomes unwritable under a running learner (its SQLite file replaced by a
    directory): the next call fails in the tracker's thread, is logged, and turns it off."""
    tracker = open_tracker(TrackerSettings(kind="mlflow", dir=tmp_path), run_name="r")
    assert isinstance(tracker, BackgroundTracker)
    tracker.log_step(1, {"loss": 1.0})
    assert tracker.flush(30) and tracker.failed is None
    (tmp_path / "mlflow.db").unlink()
    (tmp_path / "mlflow.db").mkdir()
    with capture_logs() as logs:
        tracker.log_step(2, {"loss": 0.5})  # returns at once; fails on the tracker's thread
        assert tracker.flush(30)
        tracker.log_step(3, {"loss": 0.25})  # dropped: the tracker is off
        tracker.close()
    assert tracker.failed is not None and "readonly database" in tracker.failed
    assert [e["event"] for e in logs if e["log_level"] == "warning"][:1] == ["tracker_failed"]


class Recording:
    """A backend that records its calls, fails from step `fail_from` and waits on `gate`."""

    def __init__(self, fail_from: int = 0, gate: threading.Event | None = None) -> None:
        self.steps: list[int] = []
        self.closed = False
        self.fail_from, self.gate = fail_from, gate

    def log_config(self, config: object) -> None:
        pass

    def log_step(self, step: int, stats: object) -> None:
        if self.gate is not None:
            self.gate.wait(30)
        self.steps.append(step)
        if self.fail_from and step >= self.fail_from:
            raise OSError(28, "No space left on device")

    def log_evaluation(self, step: int, results: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_logged_once_and_turned_off() -> None:
    backend = Recording(fail_from=2)
    tracker = BackgroundTracker(backend, "failing")
    with capture_logs() as logs:
        for step in (1, 2, 3, 4):
            tracker.log_step(step, {"loss": 1.0})
        assert tracker.flush(5)
        tracker.close()
    assert backend.steps == [1, 2] and backend.closed  # nothing after the failure, but closed
    assert [e["event"] for e in logs] == ["tracker_failed"] and "No space left" in logs[0]["error"]


def test_a_tracker_that_hangs_never_holds_up_the_caller() -> None:
    gate = threading.Event()
    backend = Recording(gate=gate)
    tracker = BackgroundTracker(backend, "hanging", backlog=2)
    started = time.monotonic()
    with capture_logs() as logs:
        for step in range(1, 7):
            tracker.log_step(step, {"loss": 1.0})
    assert time.monotonic() - started < 0.5
    assert tracker.dropped >= 3 and [e["event"] for e in logs] == ["tracker_behind"]  # one held, two queued
    assert not tracker.flush(0.1)
    gate.set()
    assert tracker.flush(10)
    tracker.close()
    assert backend.steps == sorted(backend.steps) and len(backend.steps) == 6 - tracker.dropped and backend.closed


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_backend_is_refused_naming_its_extra(kind: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for module in _MODULES[kind]:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(TrackerUnavailable, match=rf"pip install 'policyloop\[{EXTRAS[kind]}\]'"):
        open_tracker(TrackerSettings(kind=kind, dir=tmp_path / "tracking"), run_name="r")  # type: ignore[arg-type]
    assert not (tmp_path / "tracking").exists()


async def test_the_learner_refuses_to_start_without_its_trackers_extra(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Before it loads the model (the model path here does not exist)."""
    from policyloop.services.learner.service import body

    monkeypatch.setitem(sys.modules, "wandb", None)
    ctx = SimpleNamespace(settings=LearnerSettings(device="cpu", model_path=tmp_path / "no-model",
                                                   tracker=TrackerSettings(kind="wandb", dir=tmp_path)))
    with pytest.raises(ServiceCannotStart, match=r"tracker wandb needs wandb.*policyloop\[trackers-wandb\]"):
        await body(ctx)  # type: ignore[arg-type]


def test_a_tracker_that_cannot_open_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(TrackerUnavailable, match="tracker tensorboard could not open"):
        open_tracker(TrackerSettings(kind="tensorboard", dir=tmp_path / "file"), run_name="r")


def test_tracker_settings_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from policyloop.runtime.settings import load_settings

    monkeypatch.setenv("POLICYLOOP_TRACKER__WANDB_MODE", "offline")
    settings = load_settings(LearnerSettings, ["--tracker.kind", "wandb", "--tracker.dir", "/tmp/t"])
    assert (settings.tracker.kind, settings.tracker.dir, settings.tracker.wandb_mode) == \
        ("wandb", Path("/tmp/t"), "offline")
    assert tracker_run_name(settings) == settings.run_id
    with pytest.raises((ValueError, SystemExit)):
        load_settings(LearnerSettings, ["--tracker.kind", "neptune"])
    assert os.environ["WANDB_MODE"] == "offline"  # tests/conftest.py: no test reaches wandb's servers
