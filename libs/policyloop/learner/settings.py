"""The learner's settings: one tree of documented models. Flags are `--<field>` and
`--<group>.<field>` (e.g. `--loss.kind gspo`, `--optimizer.lr 3e-5`); env vars
`POLICYLOOP_<FIELD>` and `POLICYLOOP_<GROUP>__<FIELD>`. `model`, `max_lag` and
`groups_per_step` are the loop's shared settings (runtime.settings.ServiceSettings)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from policyloop.models.resolve import REF_HELP, ModelRef
from policyloop.rl.losses import KINDS, LossSettings
from policyloop.rl.settings import CriticSettings, OptimizerSettings
from policyloop.runtime.settings import ServiceSettings

if TYPE_CHECKING:
    from policyloop.rl.trainer import TrainerConfig


class CheckpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: Path = Field(
        Path("runs/local/checkpoints"), description="Where checkpoints (model, optimizer, RNG, version, LEDGER "
                                                    "position, recently trained ids) are written.")
    every: int = Field(
        50, ge=0, description="Versions between checkpoints; 0: by every_s only (one is also written on SIGTERM). "
                              "Steps after the newest checkpoint are replayed from the ledger on resume, so the "
                              "cadence trades checkpoint work against replay time, never data.")
    every_s: float = Field(
        2.0, ge=0, description="Seconds between checkpoints, whichever of every and every_s comes first; 0: by "
                               "every only. A checkpoint costs the step a copy of the state; it is written beside "
                               "the next steps and committed once its version is published (one write at a time), "
                               "so a restarted learner replays about every_s of steps plus one write's worth.")
    kept: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    resume: bool = Field(
        True, description="Start from the newest checkpoint and replay the steps LEDGER recorded after it, "
                          "continuing the version sequence. --no-checkpoint.resume: start from the base weights, "
                          "refused unless the model's version is 0.")


class ColocatedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engines: list[str] = Field(
        default_factory=list,
        description="Base URLs of engines on this node that take every version straight from the learner by "
                    "broadcast (SGLang init_weights_update_group / update_weights_from_distributed), as a JSON "
                    "list; their replicas run with weight_source=colocated. Versions still go to the publisher.")
    backend: Literal["nccl", "gloo"] = Field(
        "nccl", description="torch.distributed backend of the colocated broadcast (gloo: CPU engines).")
    master_address: str = Field(
        "127.0.0.1", description="Address the colocated engines reach this learner at (it hosts the group).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks of each colocated engine.")
    bucket_mb: int = Field(512, ge=1, description="Most bytes per broadcast bucket, in MiB.")
    retry_s: float = Field(
        60.0, ge=0, description="After a failed broadcast, versions go by the publisher only for this long before "
                                "the weight-update group is formed again.")


TrackerKind = Literal["none", "tensorboard", "wandb", "mlflow"]
TRACKER_KINDS: tuple[str, ...] = get_args(TrackerKind)


class TrackerSettings(BaseModel):
    """Where the learner's step statistics, the run's configuration and evaluations go
    (policyloop.learner.tracking, docs/trackers.md). Each backend is an optional extra."""

    model_config = ConfigDict(extra="forbid")

    kind: TrackerKind = Field(
        "none", description="Experiment tracker: none, tensorboard (extra trackers-tensorboard), wandb "
                            "(trackers-wandb) or mlflow (trackers-mlflow). A missing extra refuses the start.")
    dir: Path = Field(
        Path("runs/local/tracking"), description="Local files of the tracker: TensorBoard event files in "
                                                 "<dir>/tensorboard/<run name>, wandb's run files in <dir>/wandb, "
                                                 "and MLflow's default store <dir>/mlflow.db.")
    run_name: str = Field(
        "", description="The tracker's name for this run (TensorBoard run directory, wandb run name and group, "
                        "MLflow run name); empty: the learner's run_id.")
    wandb_project: str = Field("policyloop", description="wandb project the run is logged to.")
    wandb_entity: str = Field("", description="wandb entity (user or team); empty: the API key's default.")
    wandb_mode: Literal["online", "offline"] | None = Field(
        None, description="wandb online (needs WANDB_API_KEY and the network) or offline (files only, uploaded "
                          "later with `wandb sync <dir>/wandb/offline-run-*`); unset: WANDB_MODE, else online.")
    mlflow_tracking_uri: str = Field(
        "", description="MLflow tracking server or store (http://host:5000, sqlite:///path.db); empty: "
                        "MLFLOW_TRACKING_URI, else sqlite:///<dir>/mlflow.db.")
    mlflow_experiment: str = Field("policyloop", description="MLflow experiment the run is logged to (created if "
                                                             "missing).")


class LearnerSettings(ServiceSettings):
    model_path: ModelRef = Field("model", description="The base policy. " + REF_HELP)
    publisher_endpoint: str = Field("127.0.0.1:50052", description="host:port of the publisher's WeightService.")
    publisher_token: str = Field("", description="Bearer token for the publisher, if it wants one.")
    publish_deadline_s: float = Field(60.0, description="Deadline of one Push of a version to the publisher.")
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings, description="AdamW and its schedule.")
    loss: LossSettings = Field(default_factory=KINDS["ppo"])
    critic: CriticSettings = Field(default_factory=CriticSettings,
                                   description="PPO's value model, trained beside the policy with loss.advantages gae.")
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings, description="Checkpoints and resume.")
    colocated: ColocatedSettings = Field(
        default_factory=ColocatedSettings, description="Engines on this node fed by broadcast.")
    tracker: TrackerSettings = Field(
        default_factory=TrackerSettings, description="Experiment tracker of step statistics, configuration and "
                                                     "evaluations (--tracker.kind tensorboard|wandb|mlflow).")
    dedupe_steps: int = Field(
        1000, ge=1, description="Steps whose trajectory ids are remembered to recognise redelivered samples (later "
                                "ones exceed max_lag and are dropped as stale).")
    leftovers_check_s: float = Field(
        1.0, gt=0, description="While no full batch is held, how often the learner looks whether the groups it "
                               "holds are all a run has left (then it trains them in a smaller batch, so the run "
                               "can finish) or belong to a run that ended (then it drops them as run_stopped).")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads of this process.")
    share_prompts: bool = Field(
        True, description="Compute each distinct prompt of a step once (a group's samples share theirs) and run "
                          "the responses on its KV cache: the plain forward's log-probs and gradients up to float "
                          "rounding, for the prompt's tokens once per group instead of once per sample. false: one "
                          "forward over every prompt + response row.")
    full_model: bool = Field(
        True, description="Train the cluster's full-model runs (the runs the gateway starts without a LoRA spec): "
                          "the whole policy, on every rank. false: this learner trains only what lora_runs and "
                          "tinker add, and holds no trainable copy of the base.")
    lora_runs: bool = Field(
        False, description="Also train LoRA runs — each its own adapter over a frozen base, many at once, sharing "
                            "the learner fairly (learner.adapters) — beside the full model's runs. The runs are "
                            "those the gateway starts with a LoRA spec; each resumes from its own checkpoints and "
                            "ledger. Their steps take turns with the other kinds' on the device. One rank only.")
    tinker: bool = Field(
        False, description="Also train the Tinker API's models (the tinker service puts their requests on TINKER): "
                           "each its own LoRA adapter over a frozen base, checkpointed under checkpoint.dir/tinker "
                           "at every optim_step, beside the RL runs, taking turns on the device. One rank only.")
    overlap_publication: bool = Field(
        True, description="Publish version N (colocated broadcast, delta encode, push, registry, acks) while step "
                          "N+1 computes. Step N+1 is recorded in LEDGER only once N is published, so at most one "
                          "recorded version is ever unpublished, as without overlap; a checkpoint waits for its "
                          "version's publication. false: each step publishes before the next begins.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the policy trains: auto (CUDA when this torch sees a GPU, else CPU), cpu, or "
                            "cuda — which refuses to start on a CPU-only torch or a node without a visible GPU "
                            "instead of training on the CPU unnoticed (GPU images and overlays set it).")
    crash_after_recording_step: int = Field(
        0, ge=0, description="Fault injection for recovery drills: exit at once (as if killed) right after step N "
                             "is recorded in LEDGER and before its version is published — the narrowest window of "
                             "the write-ahead rule. 0: never.")

    def kinds_problem(self, world_size: int) -> str | None:
        """Why the kinds of run these settings name cannot be trained together on `world_size`
        ranks (None: they can)."""
        if not (self.full_model or self.lora_runs or self.tinker):
            return "nothing to train: set full_model, lora_runs or tinker"
        if (self.lora_runs or self.tinker) and world_size > 1:
            return "lora_runs and tinker train on one rank: run them in a learner of their own"
        if not self.full_model and self.colocated.engines:
            return "colocated engines take the full model's versions: full_model=false takes none"
        if self.loss.advantages == "gae" and not self.full_model:
            return "loss.advantages gae trains a critic beside the full model: full_model=false has none"
        return None

    def trainer_config(self) -> TrainerConfig:
        from policyloop.rl.trainer import TrainerConfig  # torch: only where a trainer is made

        return TrainerConfig(**self.optimizer.model_dump(), loss=self.loss, threads=self.torch_threads,
                             device=self.device, share_prompts=self.share_prompts, critic=self.critic)
