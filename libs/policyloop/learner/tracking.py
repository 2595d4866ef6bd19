"""Experiment trackers: the learner's step statistics, the run's configuration and evaluations
(the demo's held-out accuracy) go to TensorBoard, Weights & Biases or MLflow, as the learner's
`tracker` settings say (docs/trackers.md).

Each backend is an optional extra (trackers-tensorboard, trackers-wandb, trackers-mlflow),
imported only by its class: the base install has none of them. A tracker never holds up or
stops training: `open_tracker` hands the backend to a BackgroundTracker, whose one thread makes
its calls in order, off the event loop and off the step; the first call that fails is logged and
turns the tracker off for the rest of the process. Opening one can block (wandb starts its
service, MLflow creates its store): from async code, open it in a thread (start_learner_tracker).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from policyloop.contracts.versions import sample_lag
from policyloop.learner.figures import exported_statistics
from policyloop.runtime import ServiceCannotStart
from policyloop.runtime.settings import ServiceSettings
from policyloop.telemetry.logging import get_logger

if TYPE_CHECKING:
    from policyloop.contracts.v1 import bus_pb2, status_pb2
    from policyloop.learner.settings import LearnerSettings, TrackerSettings
    from policyloop.rl.trainer import StepReport

log = get_logger(__name__)

ConfigValue = str | int | float | bool
# Every name a tracker is given is logged under one of these (train/loss, eval/heldout_accuracy).
STEP_PREFIX = "train/"
EVALUATION_PREFIX = "eval/"
# The extra that installs each backend, and the modules its class imports.
EXTRAS = {"tensorboard": "trackers-tensorboard", "wandb": "trackers-wandb", "mlflow": "trackers-mlflow"}
_MODULES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb",),
            "mlflow": ("mlflow.tracking",)}


class TrackerUnavailable(RuntimeError):
    """The tracker asked for cannot be used: its extra is not installed, or it cannot open."""


class Tracker(Protocol):
    """What the learner and the demo log. `step` is the learner's step, which is also the policy
    version it made: evaluations of version v sit at step v, beside the statistics of step v."""

    def log_config(self, config: Mapping[str, ConfigValue]) -> None: ...

    def log_step(self, step: int, stats: Mapping[str, float]) -> None: ...

    def log_evaluation(self, step: int, results: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    """tracker=none."""

    def log_config(self, config: Mapping[str, ConfigValue]) -> None:
        pass

    def log_step(self, step: int, stats: Mapping[str, float]) -> None:
        pass

    def log_evaluation(self, step: int, results: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def require_tracker(kind: str) -> None:
    """Raises TrackerUnavailable, naming the extra to install, when a backend's packages are missing."""
    for module in _MODULES.get(kind, ()):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TrackerUnavailable(
                f"tracker {kind} needs {exc.name or module}, which is not installed ({exc}): "
                f"pip install 'policyloop[{EXTRAS[kind]}]'") from exc


class TensorBoardTracker:
    """Event files in `log_dir` (one TensorBoard run), written with torch's SummaryWriter: scalars
    by tag and step, the configuration as hparams and as a text table (tag `config`)."""

    def __init__(self, log_dir: Path) -> None:
        require_tracker("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(log_dir)
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log_config(self, config: Mapping[str, ConfigValue]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(dict(config), {}):
            self._writer.file_writer.add_summary(summary)
        rows = "".join(f"| {name} | {str(value).replace('|', '/')} |\n" for name, value in sorted(config.items()))
        self._writer.add_text("config", "| setting | value |\n| --- | --- |\n" + rows, 0)
        self._writer.flush()

    def log_step(self, step: int, stats: Mapping[str, float]) -> None:
        self._scalars(STEP_PREFIX, step, stats)

    def log_evaluation(self, step: int, results: Mapping[str, float]) -> None:
        self._scalars(EVALUATION_PREFIX, step, results)

    def _scalars(self, prefix: str, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(prefix + name, value, step)
        self._writer.flush()  # on the tracker's thread: the figures are on disk for a live TensorBoard

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A wandb run (offline: files under <directory>/wandb, uploaded later by `wandb sync`).
    train/* are charted against train/step and eval/* against eval/step, so that evaluations
    logged from another run of the same group line up with the steps. wandb's console capture,
    system metrics and code/git/requirements snapshots are off: the learner's logs and
    Prometheus carry those."""

    def __init__(self, *, project: str, entity: str, mode: str | None, directory: Path, name: str, group: str,
                 job_type: str) -> None:
        require_tracker("wandb")
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
                                  x_save_requirements=False)
        self._run = wandb.init(project=project, entity=entity or None, mode=mode, dir=str(directory), name=name,
                               group=group, job_type=job_type, settings=settings, reinit="create_new")
        for prefix in (STEP_PREFIX, EVALUATION_PREFIX):
            self._run.define_metric(prefix + "step", hidden=True)
            self._run.define_metric(prefix + "*", step_metric=prefix + "step")
        self.where = f"wandb run {self._run.id} ({self._run.dir})"

    def log_config(self, config: Mapping[str, ConfigValue]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_step(self, step: int, stats: Mapping[str, float]) -> None:
        self._log(STEP_PREFIX, step, stats)

    def log_evaluation(self, step: int, results: Mapping[str, float]) -> None:
        self._log(EVALUATION_PREFIX, step, results)

    def _log(self, prefix: str, step: int, values: Mapping[str, float]) -> None:
        # One history row per call, against its own step axis: no monotonic-step rule to break.
        self._run.log({prefix + "step": step} | {prefix + name: value for name, value in values.items()})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run in `experiment`, tagged policyloop.run=<run name> and policyloop.role=<role>:
    a learner that restarts continues its run (the newest with those tags) instead of starting
    another. Configuration as params (a param keeps its first value: MLflow refuses to change one;
    a changed setting is logged as a warning), statistics as metrics by step."""

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, role: str,
                 artifact_location: str | None = None) -> None:
        require_tracker("mlflow")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(
            experiment, artifact_location=artifact_location)
        tags = {"policyloop.run": run_name, "policyloop.role": role}
        query = " and ".join(f"tags.`{k}` = '{v.replace(chr(39), '')}'" for k, v in tags.items())
        runs = self._client.search_runs([experiment_id], filter_string=query, max_results=1,
                                        order_by=["attributes.start_time DESC"])
        if runs:
            self.run_id = runs[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            display = run_name if role == "learner" else f"{run_name}-{role}"
            self.run_id = self._client.create_run(experiment_id, run_name=display, tags=tags).info.run_id
        self.continued = bool(runs)
        self.where = f"mlflow run {self.run_id} in {experiment!r} at {tracking_uri}"

    def log_config(self, config: Mapping[str, ConfigValue]) -> None:
        from mlflow.entities import Param

        had = self._client.get_run(self.run_id).data.params
        values = {name: str(value) for name, value in config.items()}
        changed = sorted(name for name, value in values.items() if name in had and had[name] != value)
        if changed:
            log.warning("tracker_config_changed", run=self.run_id, settings=changed,
                        note="MLflow keeps a param's first value; the run's params show the earlier ones")
        params = [Param(name, value) for name, value in values.items() if name not in had]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=params[start:start + 100])

    def log_step(self, step: int, stats: Mapping[str, float]) -> None:
        self._metrics(STEP_PREFIX, step, stats)

    def log_evaluation(self, step: int, results: Mapping[str, float]) -> None:
        self._metrics(EVALUATION_PREFIX, step, results)

    def _metrics(self, prefix: str, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(prefix + name, float(value), now_ms, step)
                                                     for name, value in values.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")


class BackgroundTracker:
    """Makes a tracker's calls on a thread of its own, in order, so that the caller (the learner's
    event loop, between steps) never waits on a disk or a network. At most `backlog` calls wait;
    past that new ones are dropped and counted. The first call that raises is logged as a
    warning and turns the tracker off: later calls are dropped, and nothing reaches the caller."""

    def __init__(self, tracker: Tracker, name: str, *, backlog: int = 10_000) -> None:
        self.tracker, self.name = tracker, name
        self.failed: str | None = None   # the error that turned it off
        self.dropped = 0                 # calls dropped because the backlog was full
        self._calls: queue.Queue[Callable[[], None] | None] = queue.Queue(backlog)
        self._closed = False
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def log_config(self, config: Mapping[str, ConfigValue]) -> None:
        config = dict(config)
        self._submit(lambda: self.tracker.log_config(config))

    def log_step(self, step: int, stats: Mapping[str, float]) -> None:
        stats = dict(stats)
        self._submit(lambda: self.tracker.log_step(step, stats))

    def log_evaluation(self, step: int, results: Mapping[str, float]) -> None:
        results = dict(results)
        self._submit(lambda: self.tracker.log_evaluation(step, results))

    def _submit(self, call: Callable[[], None]) -> None:
        if self._closed or self.failed is not None:
            return
        with self._idle:
            self._pending += 1
        try:
            self._calls.put_nowait(call)
        except queue.Full:
            self._done()
            self.dropped += 1
            if self.dropped == 1:
                log.warning("tracker_behind", tracker=self.name, backlog=self._calls.maxsize,
                            note="calls are dropped until it catches up; training goes on")

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                if self.failed is None:
                    call()
            except Exception as exc:  # any error of a tracker only turns it off
                self.failed = repr(exc)
                log.warning("tracker_failed", tracker=self.name, error=self.failed,
                            note="the tracker is off for the rest of this process; training goes on")
            finally:
                self._done()
        try:
            self.tracker.close()
        except Exception as exc:
            log.warning("tracker_close_failed", tracker=self.name, error=repr(exc))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every call submitted so far was made (or dropped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Makes the calls still waiting, then closes the backend (wandb finishes its run, MLflow
        marks it finished); waits at most `timeout_s` for a backend that hangs."""
        if self._closed:
            return
        self._closed = True
        try:
            self._calls.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("tracker_close_timed_out", tracker=self.name)
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tracker_close_timed_out", tracker=self.name)


def open_tracker(settings: TrackerSettings, *, run_name: str, role: str = "learner") -> Tracker:
    """The tracker `settings` name, open and working on its own thread (a NullTracker for kind
    none). `role` names the writer: the learner's run is `run_name`; another role (the demo's
    evaluation) writes beside it — TensorBoard run <run_name>/<role>, a wandb run of the same
    group, an MLflow run <run_name>-<role>. Blocks while the backend opens. Raises
    TrackerUnavailable when its extra is missing or it cannot open."""
    if settings.kind == "none":
        return NullTracker()
    require_tracker(settings.kind)
    try:
        backend = _open_backend(settings, run_name, role)
    except Exception as exc:
        raise TrackerUnavailable(f"tracker {settings.kind} could not open: {exc}") from exc
    log.info("tracker_opened", kind=settings.kind, run=run_name, role=role, where=backend.where)
    return BackgroundTracker(backend, f"{settings.kind}:{run_name}:{role}")


def _open_backend(settings: TrackerSettings, run_name: str, role: str) -> TensorBoardTracker | WandbTracker | \
        MlflowTracker:
    if settings.kind == "tensorboard":
        log_dir = settings.dir / "tensorboard" / run_name
        return TensorBoardTracker(log_dir if role == "learner" else log_dir / role)
    if settings.kind == "wandb":
        return WandbTracker(project=settings.wandb_project, entity=settings.wandb_entity, mode=settings.wandb_mode,
                            directory=settings.dir, name=run_name if role == "learner" else f"{run_name}-{role}",
                            group=run_name, job_type=role)
    if settings.kind == "mlflow":
        uri = mlflow_tracking_uri(settings)
        artifacts = None
        if uri == _local_mlflow_store(settings):
            settings.dir.mkdir(parents=True, exist_ok=True)
            artifacts = (settings.dir / "mlflow-artifacts").resolve().as_uri()
        return MlflowTracker(tracking_uri=uri, experiment=settings.mlflow_experiment, run_name=run_name, role=role,
                             artifact_location=artifacts)
    raise TrackerUnavailable(f"unknown tracker {settings.kind!r}")


def mlflow_tracking_uri(settings: TrackerSettings) -> str:
    """The setting, else MLFLOW_TRACKING_URI, else a SQLite store in the tracker's directory."""
    return settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or _local_mlflow_store(settings)


def _local_mlflow_store(settings: TrackerSettings) -> str:
    return f"sqlite:///{(settings.dir / 'mlflow.db').resolve()}"


# --- the learner's use of it -------------------------------------------------------------------

# ServiceSettings fields that are plumbing (addresses, ports, timings), not the run's configuration;
# the loop's shared settings and the run id stay.
_PLUMBING = set(ServiceSettings.model_fields) - {"model", "max_lag", "groups_per_step", "run_id"}
_SECRET = re.compile(r"(^|[._])(token|secret|password|api_key|credentials?)([._]|$)", re.IGNORECASE)


def run_config(settings: LearnerSettings) -> dict[str, ConfigValue]:
    """The learner's settings as the run's configuration: flat (`loss.kind`, `optimizer.lr`),
    without the plumbing every service shares, and without secrets (any setting whose name has
    the word token, secret, password, api_key or credentials: publisher_token)."""
    flat: dict[str, ConfigValue] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}{key}.", inner)
        elif not _SECRET.search(prefix):
            flat[prefix[:-1]] = value if isinstance(value, str | int | float | bool) else \
                "" if value is None else json.dumps(value)

    walk("", settings.model_dump(mode="json", exclude=_PLUMBING))
    return flat


def step_statistics(report: StepReport, seconds: float, samples: Sequence[bus_pb2.Trajectory],
                    trained_version: int, status: status_pb2.LearnerStatus | None = None) -> dict[str, float]:
    """What a tracker gets for one step (under train/; docs/trackers.md): the statistics the
    learner exports (mean reward, gradient norm, the loss's by name), the step's size and time,
    its samples' version lag, and (the full model's learner: `status`) the run's totals."""
    lags = [sample_lag(t, trained_version) for t in samples]
    stats = exported_statistics(report)
    stats |= {
        "step_seconds": seconds,             # the whole step: train, record, push, advance
        "train_seconds": report.seconds,     # the optimizer step alone
        "samples": report.samples,
        "groups": report.groups,
        "trained_tokens": report.trained_tokens,
        "version": trained_version + 1,
        "lag_mean": sum(lags) / len(lags) if lags else 0.0,
        "lag_max": max(lags, default=0),
    }
    if status is not None:
        stats |= {"trained_samples_total": status.trained_samples, "trained_tokens_total": status.trained_tokens}
        stats |= {f"dropped_{f.name}": getattr(status.dropped, f.name) for f in status.dropped.DESCRIPTOR.fields}
    return {name: float(value) for name, value in stats.items()}


def tracker_run_name(settings: LearnerSettings) -> str:
    return settings.tracker.run_name or settings.run_id


def open_learner_tracker(settings: LearnerSettings) -> Tracker:
    """The learner's tracker, open, with the run's configuration logged."""
    tracker = open_tracker(settings.tracker, run_name=tracker_run_name(settings))
    tracker.log_config(run_config(settings))
    return tracker


# Opens a LoRA run's tracker: (run id, the run's own settings) -> an open tracker.
RunTrackerOpener = Callable[[str, Mapping[str, ConfigValue]], Tracker]


def lora_run_trackers(settings: LearnerSettings) -> RunTrackerOpener | None:
    """How the learner opens each LoRA run's tracker (None: tracker kind none). A LoRA run is a
    tracker run of its own, named after the run (a TensorBoard run, a wandb run, an MLflow run),
    its configuration the learner's and the run's (its adapter, batch and staleness bound)."""
    if settings.tracker.kind == "none":
        return None

    def open_run(run_id: str, run_settings: Mapping[str, ConfigValue]) -> Tracker:
        tracker = open_tracker(settings.tracker, run_name=run_id)
        tracker.log_config(run_config(settings) | {"run_id": run_id} | dict(run_settings))
        return tracker

    return open_run


async def start_learner_tracker(settings: LearnerSettings) -> Tracker:
    """open_learner_tracker in a thread; a tracker that cannot open refuses the learner's start."""
    try:
        return await asyncio.to_thread(open_learner_tracker, settings)
    except TrackerUnavailable as exc:
        raise ServiceCannotStart(str(exc)) from exc
