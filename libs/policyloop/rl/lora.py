"""LoRA runs on one frozen base model: each run trains its own peft adapter with its own AdamW
state, LR schedule, step count and version sequence, so that many runs share a learner (and its
base weights) without touching each other.

A run's adapter is the only thing its steps change: the base weights never get gradients, and
a step of one run leaves every other run's adapter and optimizer state as they were. The KL
penalty's reference is the base itself (the adapters switched off), so it costs no second model.
The trainer runs on one rank; the base is not sharded.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from policyloop.common.device import resolve_device
from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.batching import ModelLimits
from policyloop.rl.logprobs import PackedBatch, token_logprobs
from policyloop.rl.settings import (
    DEFAULT_TARGET_MODULES,
    LoraSpec,
    OptimizerSettings,
    adapter_model_name,
    run_directory,
)
from policyloop.rl.trainer import LrSchedule, StepReport, TrainerConfig, grpo_loss
from policyloop.telemetry.phases import PhaseClock

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["DEFAULT_TARGET_MODULES", "AdapterTrainer", "LoraSpec", "UnknownRun", "adapter_model_name",
           "run_directory"]

# A run's checkpoint: its adapter, its optimizer's state, and the rest.
ADAPTER_FILE, OPTIMIZER_FILE, RUN_FILE = "adapter_model.safetensors", "optimizer.pt", "run.json"


def _adaptable(name: str, module: torch.nn.Module) -> bool:
    """A linear module of the base, or one an adapter already wraps (its base_layer is the linear)."""
    if ".lora_" in name or name.endswith(".base_layer"):
        return False  # the inside of an adapted module
    return isinstance(module, torch.nn.Linear) or isinstance(getattr(module, "base_layer", None), torch.nn.Linear)


def check_target_modules(spec: LoraSpec, model: torch.nn.Module) -> None:
    """Raises ValueError naming target_modules when the model has no linear module of a name."""
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if _adaptable(name, module)}
    missing = [n for n in spec.target_modules if n not in linear]
    if missing:
        raise ValueError(f"target_modules: the model has no linear modules named {missing} (it has {sorted(linear)})")


class UnknownRun(KeyError):
    pass


@dataclass
class AdapterRun:
    """A run's state on the learner."""

    run_id: str
    adapter: str                     # its adapter's name in the peft model
    spec: LoraSpec
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    steps: int = 0
    version: int = 0


@dataclass(frozen=True)
class AdapterCheckpoint:
    """What a run's checkpoint holds besides tensors."""

    run_id: str
    version: int
    steps: int
    trained_ids: list[list[str]]
    extra: dict[str, Any]


def save_adapter_directory(tensors: dict[str, torch.Tensor], spec: LoraSpec, directory: Path,
                           base_model: str = "") -> Path:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors) of a run's
    adapter tensors, as an engine's /load_lora_adapter takes it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = spec.peft_config()
    config.base_model_name_or_path = base_model or None
    config.save_pretrained(str(directory))
    safetensors.torch.save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / ADAPTER_FILE))
    return directory


def adapter_config_dict(spec: LoraSpec, base_model: str = "") -> dict[str, Any]:
    """The run's adapter_config.json as a JSON-ready dict (what an engine's
    /load_lora_adapter_from_tensors takes as config_dict)."""
    config = spec.peft_config()
    config.base_model_name_or_path = base_model or None
    return json.loads(json.dumps(config.to_dict(), default=lambda value: sorted(value)
                                 if isinstance(value, set | frozenset) else str(value)))


def adapter_safetensors(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """A run's adapter tensors as one safetensors file, with each tensor's sha256 (of its raw
    bytes, as an engine checks what it received)."""
    import hashlib

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    checksums = {name: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                 for name, t in tensors.items()}
    return safetensors.torch.save(tensors), checksums


def latest_run_checkpoint(root: Path, run_id: str) -> Path | None:
    """The newest complete checkpoint of `run_id` under `root`."""
    from policyloop.rl.checkpoint import LATEST

    runs_root = Path(root) / run_directory(run_id)
    pointer = runs_root / LATEST
    if not pointer.exists():
        return None
    directory = runs_root / pointer.read_text().strip()
    return directory if (directory / RUN_FILE).exists() else None


class AdapterTrainer:
    """One frozen base model and a LoRA adapter per run; `step(run_id, groups)` is one GRPO
    update of that run's adapter (the objective of `config.loss`, as the full-parameter trainer's)."""

    def __init__(self, model_path: Path, config: TrainerConfig) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(config.threads)
        self.config = config
        self.model_path = Path(model_path)
        self.device = torch.device(resolve_device(config.device))
        base = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
        base.requires_grad_(False)
        self.base = base
        self.model: PeftModel | None = None  # made with the first run's adapter
        self.runs: dict[str, AdapterRun] = {}
        self._made = 0  # adapters made so far: their names are never reused
        pad = getattr(base.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.limits = ModelLimits.of(base.config)

    def add_run(self, run_id: str, spec: LoraSpec, optimizer: OptimizerSettings | None = None) -> AdapterRun:
        """A new adapter for `run_id` (B = 0: the run starts at the base policy), with an AdamW of
        its own over its parameters alone. `optimizer`: the run's (default: the trainer's)."""
        from peft import get_peft_model

        if run_id in self.runs:
            raise ValueError(f"run {run_id!r} has an adapter already")
        check_target_modules(spec, self.base)
        adapter = f"run{self._made}"  # run ids may hold characters a module name may not
        self._made += 1
        if self.model is None:
            self.model = get_peft_model(self.base, spec.peft_config(), adapter_name=adapter)
        else:
            self.model.add_adapter(adapter, spec.peft_config())
        self.model.base_model.model.requires_grad_(False)  # the base and every other adapter
        params = self._parameters(adapter)
        for p in params:
            p.requires_grad_(True)
        settings = optimizer or self.config
        opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        run = AdapterRun(run_id, adapter, spec, opt, torch.optim.lr_scheduler.LambdaLR(opt, LrSchedule(settings)))
        self.runs[run_id] = run
        return run

    def remove_run(self, run_id: str) -> None:
        """Frees the run's adapter and optimizer state."""
        run = self.run(run_id)
        assert self.model is not None
        self.model.delete_adapter(run.adapter)
        del self.runs[run_id]

    def run(self, run_id: str) -> AdapterRun:
        try:
            return self.runs[run_id]
        except KeyError:
            raise UnknownRun(run_id) from None

    def step(self, run_id: str, groups: Sequence[Sequence[bus_pb2.Trajectory]]) -> StepReport:
        """One update of `run_id`'s adapter on complete groups; its version advances by one."""
        run = self.run(run_id)
        model = self._activate(run)
        started = time.monotonic()
        clock = PhaseClock(torch.cuda.synchronize if self.device.type == "cuda" else lambda: None)
        model.train(run.spec.dropout > 0)

        share = self.config.share_prompts

        def base_logprobs(batch: PackedBatch) -> torch.Tensor:
            with model.disable_adapter():
                return token_logprobs(model, batch, share_prompts=share)

        reference = base_logprobs if self.config.loss.kl_coef > 0 else None
        step_loss = grpo_loss(model, groups, self.config.loss, pad_id=self.pad_id, device=self.device,
                              reference=reference, clock=clock, share_prompts=share)
        step_loss.loss.backward()
        clock.lap("backward")
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        model.eval()
        run.steps += 1
        run.version += 1
        return step_loss.report(run.steps, grad_norm, time.monotonic() - started, clock.seconds)

    def export_adapter(self, run_id: str) -> dict[str, torch.Tensor]:
        """The run's adapter tensors under peft's saved names (what `save_pretrained` writes as
        adapter_model.safetensors), on the CPU."""
        from peft import get_peft_model_state_dict

        run = self.run(run_id)
        assert self.model is not None
        state = get_peft_model_state_dict(self.model, adapter_name=run.adapter)
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}

    def save(self, root: Path, run_id: str, trained_ids: Sequence[Sequence[str]] = (),
             extra: dict[str, Any] | None = None, keep: int = 2, suffix: str = "") -> Path:
        """Checkpoints one run at its version: `<root>/<run dir>/version-<v>/` with its adapter
        (adapter_model.safetensors, peft's names), its AdamW state, and run.json (run id, spec,
        version, steps, schedule position, the ids its recent steps trained, `extra`). Written
        aside and renamed into place, as the full trainer's checkpoints."""
        from policyloop.rl.checkpoint import commit_checkpoint

        run = self.run(run_id)
        runs_root = Path(root) / run_directory(run_id)
        # `suffix` tells apart checkpoints of one version (the directory `latest` names is never
        # the one rewritten).
        final = runs_root / f"version-{run.version:09d}{suffix}"
        tmp = runs_root / f".version-{run.version:09d}{suffix}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        safetensors.torch.save_file(self.export_adapter(run_id), str(tmp / ADAPTER_FILE))
        torch.save(run.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        record = {"run_id": run.run_id, "spec": run.spec.model_dump(mode="json"), "version": run.version,
                  "steps": run.steps, "scheduler": {"last_epoch": run.scheduler.last_epoch},
                  "trained_ids": [list(ids) for ids in trained_ids], "extra": dict(extra or {}),
                  "written_unix": time.time()}
        (tmp / RUN_FILE).write_text(json.dumps(record))
        commit_checkpoint(tmp, final, keep)
        return final

    def restore(self, directory: Path, optimizer: OptimizerSettings | None = None, *, run_id: str | None = None,
                optimizer_state: bool = True) -> AdapterCheckpoint:
        """Loads a run's checkpoint: the run is added (with the saved spec) if this trainer has
        no adapter for it, then its adapter, AdamW state, schedule, steps and version are set.
        `run_id`: load it as another run (default: the run that saved it); `optimizer_state`
        false: the adapter alone, the run's AdamW state as it was (fresh for a new run)."""
        from peft import set_peft_model_state_dict

        directory = Path(directory)
        record = json.loads((directory / RUN_FILE).read_text())
        spec = LoraSpec.model_validate(record["spec"])
        run_id = run_id or record["run_id"]
        if run_id not in self.runs:
            self.add_run(run_id, spec, optimizer)
        run = self.runs[run_id]
        if run.spec != spec:
            raise ValueError(f"run {run_id!r}: the checkpoint's LoRA spec {spec} is not the run's {run.spec}")
        assert self.model is not None
        tensors = safetensors.torch.load_file(str(directory / ADAPTER_FILE), device=str(self.device))
        result = set_peft_model_state_dict(self.model, tensors, adapter_name=run.adapter)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"run {run_id!r}: the checkpoint holds tensors its adapter lacks: {unexpected[:3]}")
        if optimizer_state:
            run.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))
        run.scheduler.last_epoch = int(record["scheduler"]["last_epoch"])
        run.version, run.steps = int(record["version"]), int(record["steps"])
        return AdapterCheckpoint(run_id, run.version, run.steps, [list(ids) for ids in record["trained_ids"]],
                                 dict(record["extra"]))

    def adapter_parameters(self, run_id: str) -> dict[str, torch.Tensor]:
        """The run's live adapter parameters by their name in the model."""
        adapter = self.run(run_id).adapter
        assert self.model is not None
        return {name: p for name, p in self.model.named_parameters() if f".{adapter}." in name}

    def _parameters(self, adapter: str) -> list[torch.nn.Parameter]:
        assert self.model is not None
        params = [p for name, p in self.model.named_parameters() if f".{adapter}." in name]
        if not params:
            raise RuntimeError(f"adapter {adapter} has no parameters")
        return params

    def _activate(self, run: AdapterRun) -> PeftModel:
        assert self.model is not None
        if self.model.active_adapter != run.adapter:
            self.model.set_adapter(run.adapter)
        # set_adapter marks the active adapter trainable; every other one stays frozen.
        for name, p in self.model.named_parameters():
            p.requires_grad_(f".{run.adapter}." in name)
        return self.model


class RunTrainer:
    """One run of an AdapterTrainer seen as a trainer of one version sequence: what a resume
    (rl.recovery.resume) restores and replays."""

    def __init__(self, trainer: AdapterTrainer, run_id: str) -> None:
        self.trainer, self.run_id = trainer, run_id

    @property
    def version(self) -> int:
        return self.trainer.run(self.run_id).version

    def restore(self, directory: Path) -> AdapterCheckpoint:
        return self.trainer.restore(directory)

    def step(self, groups: Sequence[Sequence[bus_pb2.Trajectory]]) -> StepReport:
        return self.trainer.step(self.run_id, groups)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return self.trainer.export_adapter(self.run_id)

