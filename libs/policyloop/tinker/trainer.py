"""Tinker training requests executed on the learner's AdapterTrainer: each Tinker model is a
LoRA run (its own adapter, AdamW state and version sequence over the shared frozen base).

forward_backward adds to the adapter's gradients and optim_step applies them (Adam with the
request's parameters), then checkpoints the run with the TINKER stream sequence it covers.
Gradients between two optim_steps live only in memory: after a restart they are recomputed by
applying the same forward_backward requests (still on the stream) to the checkpointed weights,
which gives the same gradients and the same results, so nothing accepted is lost and no
optim_step is applied twice."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from policyloop.contracts.v1 import tinker_pb2, tinker_wire_pb2
from policyloop.rl.lora import AdapterTrainer, LoraSpec, latest_run_checkpoint
from policyloop.rl.objective import Objective
from policyloop.rl.settings import run_directory
from policyloop.telemetry.logging import get_logger
from policyloop.tinker import wire
from policyloop.tinker.losses import LossInputError, LossSpec

log = get_logger(__name__)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0  # the update is scaled by alpha / rank, as the hosted service's LoRA
STREAM_SEQ = "tinker_stream_seq"  # the checkpoint's `extra` key: the TINKER sequence it covers
SAMPLER_VERSION = "tinker_sampler_version"  # and the last adapter version published for samplers


SAVED_FROM = "tinker_saved_from"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def checkpoint_name(name: str) -> str:
    if not _NAME.match(name):
        raise TinkerRequestError(f"path: a checkpoint name of letters, digits, '.', '_' and '-' (at most 128), "
                                 f"got {name!r}")
    return name


def parse_weights_path(path: str) -> tuple[str, str]:
    """(model id, name) of tinker://<model id>/weights/<name>."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != "weights" or not parts[0]:
        raise TinkerRequestError(f"path: expected tinker://<model id>/weights/<name>, got {path!r}")
    return parts[0], checkpoint_name(parts[2])


LOGIT_BUDGET = 2**27  # float32 logits of one micro-batch (512 MiB; log_softmax makes a second)


def micro_batches(lengths: list[int], vocab_size: int) -> list[list[int]]:
    """Consecutive datum indices in groups whose padded logits fit LOGIT_BUDGET (one datum at
    least per group)."""
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i, length in enumerate(lengths):
        wider = max(width, length)
        if current and (len(current) + 1) * wider * vocab_size > LOGIT_BUDGET:
            groups.append(current)
            current, wider = [], length
        current.append(i)
        width = wider
    if current:
        groups.append(current)
    return groups


def _saved_seq(directory: Path) -> int:
    """The TINKER sequence of the save_weights request that wrote a saved state."""
    return int(json.loads((directory / "run.json").read_text())["extra"].get(STREAM_SEQ, 0))


def _covered_seq(directory: Path) -> int:
    return int(directory.name.rsplit("-seq", 1)[1])



class TokenWeightedMeans:
    """A request's loss statistics over its micro-batches, each weighted by its trained tokens
    (the sums, loss and policy_loss, are loss:sum's already)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, result: Objective, tokens: int) -> None:
        self.tokens += tokens
        for name, value in result.statistics.items():
            if name not in ("loss", "policy_loss"):
                self.sums[name] = self.sums.get(name, 0.0) + value * tokens

    def means(self) -> dict[str, float]:
        return {name: total / self.tokens for name, total in self.sums.items()} if self.tokens else {}


class TinkerRequestError(ValueError):
    """A request that cannot be done as asked (category "user"); the message names the field."""


def lora_spec(create: tinker_pb2.TinkerCreateModel, tied_embeddings: bool) -> LoraSpec:
    """The adapter a create_model asks for. A model whose unembedding is tied to its embedding
    takes no LoRA on lm_head (peft would then save the whole embedding with every adapter)."""
    unembed = UNEMBED_MODULES if create.train_unembed and not tied_embeddings else ()
    modules = (ATTENTION_MODULES if create.train_attn else ()) + (MLP_MODULES if create.train_mlp else ()) + unembed
    if not modules:
        raise TinkerRequestError("lora_config: train_attn, train_mlp and train_unembed are all false: "
                                 "nothing to train")
    if not 1 <= create.rank <= 1024:
        raise TinkerRequestError(f"lora_config.rank: {create.rank} is outside [1, 1024]")
    return LoraSpec(rank=create.rank, alpha=LORA_ALPHA, target_modules=modules)


@dataclass
class TinkerModel:
    model_id: str
    spec: LoraSpec
    stream_seq: int = 0                  # the last TINKER sequence applied to it
    pending: int = 0                     # forward_backward calls whose gradients wait for optim_step
    checkpointed: int = 0                # the TINKER sequence its newest checkpoint covers
    to_checkpoint: bool = False          # its weights changed: checkpoint once the result is out
    sampler_version: int = 0             # the last adapter version published for samplers
    saved: dict[str, Path] = field(default_factory=dict)


class TinkerTrainer:
    def __init__(self, trainer: AdapterTrainer, root: Path, base_model: str) -> None:
        self.trainer, self.root, self.base_model = trainer, Path(root), base_model
        self.models: dict[str, TinkerModel] = {}
        self.vocab_size = int(trainer.base.config.vocab_size)

    # -- recovery -------------------------------------------------------------------------------

    def restore_all(self) -> int:
        """Loads every model's newest complete checkpoint under root (an older kept one when the
        newest cannot be read); returns the TINKER sequence to read from (the oldest a model
        still needs; 1 when there is nothing)."""
        checkpoints = self.root / "checkpoints"
        for run_root in sorted(p for p in checkpoints.iterdir() if p.is_dir()) if checkpoints.exists() else []:
            # Newest first by the stream sequence each covers (a loaded state can take the version back).
            for directory in sorted(run_root.glob("version-*-seq*"), key=_covered_seq, reverse=True):
                try:
                    record = json.loads((directory / "run.json").read_text())
                    restored = self.trainer.restore(directory)
                except Exception as exc:  # noqa: BLE001 - half-written or damaged (any reader's error): the one before
                    log.warning("tinker_checkpoint_unreadable", directory=str(directory), error=repr(exc))
                    continue
                seq = int(restored.extra[STREAM_SEQ])
                self.models[restored.run_id] = TinkerModel(
                    restored.run_id, LoraSpec.model_validate(record["spec"]), seq, 0, seq,
                    sampler_version=int(restored.extra.get(SAMPLER_VERSION, 0)))
                log.info("tinker_model_restored", model=restored.run_id, stream_seq=seq, step=restored.steps)
                break
        return min((m.stream_seq for m in self.models.values()), default=0) + 1

    def covers(self, model_id: str, stream_seq: int) -> bool:
        """Whether the request at `stream_seq` is already reflected in the model's state."""
        model = self.models.get(model_id)
        return model is not None and stream_seq <= model.stream_seq

    # -- requests -------------------------------------------------------------------------------

    def apply(self, request: tinker_pb2.TinkerRequest, stream_seq: int) -> tinker_pb2.TinkerResult:
        """Executes one request; a request that cannot be done answers an error and changes nothing."""
        result = tinker_pb2.TinkerResult(request_id=request.request_id, model_id=request.model_id)
        op = request.WhichOneof("op")
        try:
            if op == "create_model":
                result.created.CopyFrom(self._create(request.model_id, request.create_model, stream_seq))
            elif op == "load_weights" and request.model_id not in self.models:  # a model created from a state
                result.loaded.CopyFrom(self._load(request.model_id, request.load_weights, stream_seq))
            else:
                model = self._model(request.model_id)
                if op == "forward_backward":
                    result.forward_backward.CopyFrom(self._forward_backward(model, request.forward_backward))
                elif op == "optim_step":
                    result.optim_step.CopyFrom(self._optim_step(model, request.optim_step, stream_seq))
                elif op == "save_weights":
                    result.saved.CopyFrom(self._save(model, request.save_weights, stream_seq))
                elif op == "load_weights":
                    result.loaded.CopyFrom(self._load(model.model_id, request.load_weights, stream_seq))
                else:
                    raise TinkerRequestError(f"{op}: not supported by this learner")
                model.stream_seq = max(model.stream_seq, stream_seq)
        except (TinkerRequestError, LossInputError, wire.WireError) as exc:
            result.error.CopyFrom(tinker_pb2.TinkerError(message=str(exc), category="user"))
        return result

    def _model(self, model_id: str) -> TinkerModel:
        model = self.models.get(model_id)
        if model is None:
            raise TinkerRequestError(f"model_id: no model {model_id!r} on this learner")
        return model

    def _create(self, model_id: str, create: tinker_pb2.TinkerCreateModel, stream_seq: int) -> tinker_pb2.TinkerCreated:
        if create.base_model != self.base_model:
            raise TinkerRequestError(f"base_model: this cluster trains {self.base_model!r}, not {create.base_model!r}")
        if model_id in self.models:
            raise TinkerRequestError(f"model_id: {model_id!r} exists already")
        spec = lora_spec(create, bool(getattr(self.trainer.base.config, "tie_word_embeddings", False)))
        # The adapter's A matrices are random: seeded by the request (or the model id), so a
        # replay after a restart makes the same adapter.
        seed = create.seed if create.HasField("seed") else xxhash.xxh64_intdigest(model_id.encode())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed % 2**63)
            try:
                self.trainer.add_run(model_id, spec)
            except ValueError as exc:
                raise TinkerRequestError(f"lora_config: {exc}") from None
        model = TinkerModel(model_id, spec, stream_seq, to_checkpoint=True)
        self.models[model_id] = model
        return tinker_pb2.TinkerCreated(model_id=model_id, lora_rank=spec.rank)

    def _forward_backward(self, model: TinkerModel,
                          request: tinker_wire_pb2.ForwardBackwardRequest) -> tinker_wire_pb2.ForwardBackwardOutput:
        examples = wire.examples(request, self.vocab_size)
        names = set(examples[0].inputs)
        if any(set(e.inputs) != names for e in examples):
            raise TinkerRequestError("data: every datum must carry the same loss_fn_inputs")
        loss = LossSpec.parse(request.loss_fn, wire.loss_config(request), names)
        peft_model = self.trainer._activate(self.trainer.run(model.model_id))
        outputs: dict[str, list[np.ndarray]] = {"logprobs": [], "elementwise_loss": []}
        total = 0.0
        statistics = TokenWeightedMeans()
        # Datums in right-padded micro-batches whose logits stay within LOGIT_BUDGET values; each
        # datum's loss is its own rows' sum, and the gradients of the micro-batches add up.
        for rows in micro_batches([len(e.tokens) for e in examples], self.vocab_size):
            result = self._micro_batch(peft_model, loss, [examples[i] for i in rows], request.forward_only, outputs)
            total += float(result.loss.detach())
            statistics.add(result, sum(len(examples[i].tokens) for i in rows))
        if not request.forward_only:
            model.pending += 1
        if not math.isfinite(total):
            log.warning("tinker_loss_not_finite", model=model.model_id, loss=total)
        # The loss kind's statistics (rl.objective), reduced over chunks by the SDK as means.
        means = {f"{name}:mean": value for name, value in statistics.means().items()}
        return wire.output(outputs, {"loss:sum": total, **means})

    def _micro_batch(self, peft_model: torch.nn.Module, loss: LossSpec, examples: list[wire.Example],
                     forward_only: bool, outputs: dict[str, list[np.ndarray]]) -> Objective:
        device = self.trainer.device
        lengths = [len(e.tokens) for e in examples]
        width = max(lengths)
        ids = torch.full((len(examples), width), self.trainer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        targets = torch.zeros((len(examples), width), dtype=torch.long)
        for row, example in enumerate(examples):
            ids[row, :lengths[row]] = torch.as_tensor(example.tokens)
            mask[row, :lengths[row]] = 1
            targets[row, :lengths[row]] = torch.as_tensor(example.inputs["target_tokens"].astype(np.int64))
        ids, mask, targets = ids.to(device), mask.to(device), targets.to(device)
        with torch.set_grad_enabled(not forward_only):
            logits = peft_model(input_ids=ids, attention_mask=mask).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            inputs = [{name: torch.as_tensor(array, device=device).float()
                       for name, array in example.inputs.items() if name != "target_tokens"} for example in examples]
            result = loss.compute(logprobs, lengths, inputs)
            for row in range(len(examples)):
                outputs["logprobs"].append(logprobs[row, :lengths[row]].detach().cpu().numpy().astype(np.float32))
                outputs["elementwise_loss"].append(
                    result.per_token[row, :lengths[row]].detach().cpu().numpy().astype(np.float32))
            if not forward_only:
                result.loss.backward()
        return result

    def _optim_step(self, model: TinkerModel, adam: tinker_pb2.TinkerAdamParams,
                    stream_seq: int) -> tinker_pb2.TinkerOptimStepDone:
        checks = {"learning_rate": adam.learning_rate >= 0, "beta1": 0 <= adam.beta1 < 1,
                  "beta2": 0 <= adam.beta2 < 1, "eps": adam.eps >= 0, "weight_decay": adam.weight_decay >= 0,
                  "grad_clip_norm": adam.grad_clip_norm >= 0}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise TinkerRequestError(f"adam_params.{bad[0]}: out of range ({getattr(adam, bad[0])})")
        run = self.trainer.run(model.model_id)
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        for group in run.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.steps += 1
        run.version += 1
        applied, model.pending = model.pending, 0
        model.to_checkpoint = True
        return tinker_pb2.TinkerOptimStepDone(step=run.steps, metrics={
            "grad_norm:mean": grad_norm, "forward_backward_calls:sum": float(applied)})

    def _save(self, model: TinkerModel, save: tinker_pb2.TinkerSaveWeights, stream_seq: int) -> tinker_pb2.TinkerSaved:
        """save_weights (save_state): the adapter and its AdamW state under a name, kept until
        saved again over it; save_weights_for_sampler is the worker's (it publishes)."""
        if save.for_sampler:
            raise TinkerRequestError("save_weights_for_sampler: this learner publishes no weights (no publisher)")
        name = checkpoint_name(save.name)
        root = self._named_root(model.model_id, name)
        path = f"tinker://{model.model_id}/weights/{name}"
        existing = latest_run_checkpoint(root, model.model_id)
        if existing is not None and _saved_seq(existing) == stream_seq:
            return tinker_pb2.TinkerSaved(path=path)  # this very request, applied again after a restart
        if existing is not None and not save.overwrite:
            raise TinkerRequestError(f"path: {save.name!r} is saved already (overwrite it with overwrite=True)")
        self.trainer.save(root, model.model_id, keep=1, extra={SAVED_FROM: model.model_id, STREAM_SEQ: stream_seq})
        return tinker_pb2.TinkerSaved(path=path)

    def _load(self, model_id: str, load: tinker_pb2.TinkerLoadWeights, stream_seq: int) -> tinker_pb2.TinkerLoaded:
        """load_weights: a saved state into `model_id` — a new model (created from the state, with
        its LoRA configuration) or an existing one of the same configuration."""
        source, name = parse_weights_path(load.path)
        directory = latest_run_checkpoint(self._named_root(source, name), source)
        # A state saved after this request (seen when it is applied again after a restart) was
        # not there when it came: the request gets the answer it got then.
        if directory is None or _saved_seq(directory) > stream_seq:
            raise TinkerRequestError(f"path: nothing is saved at {load.path!r}")
        existing = self.models.get(model_id)
        saved_spec = LoraSpec.model_validate(json.loads((directory / "run.json").read_text())["spec"])
        if existing is not None and existing.spec != saved_spec:
            raise TinkerRequestError(f"path: {load.path!r} holds an adapter of another configuration "
                                     f"({saved_spec}) than model {model_id!r} ({existing.spec})")
        if existing is not None and existing.pending:
            raise TinkerRequestError(f"model_id: {model_id!r} has gradients waiting for an optim_step")
        self.trainer.restore(directory, run_id=model_id, optimizer_state=load.optimizer)
        model = existing or TinkerModel(model_id, saved_spec, stream_seq)
        self.models[model_id] = model
        model.stream_seq, model.to_checkpoint = max(model.stream_seq, stream_seq), True
        return tinker_pb2.TinkerLoaded(path=load.path)

    def _named_root(self, model_id: str, name: str) -> Path:
        return self.root / "saved" / run_directory(model_id) / name

    def sampler_weights(self, model_id: str) -> tuple[int, dict[str, torch.Tensor], LoraSpec]:
        """The model's next sampler version and its adapter tensors, to publish."""
        model = self._model(model_id)
        return model.sampler_version + 1, self.trainer.export_adapter(model_id), model.spec

    def published_for_sampler(self, model_id: str, version: int, stream_seq: int) -> None:
        """Records a published sampler version: the model is checkpointed with it once the result
        is out, so a replay after a restart never publishes it again."""
        model = self._model(model_id)
        model.sampler_version = version
        model.stream_seq = max(model.stream_seq, stream_seq)
        # A checkpoint now would cover forward_backward calls whose gradients it does not hold:
        # with gradients pending, the next optim_step's checkpoint records the version (a replay
        # pushes the same version again, which the publisher takes as held).
        model.to_checkpoint = model.pending == 0

    def commit(self, model_id: str) -> None:
        """Checkpoints the model if its last request changed its weights: called once that
        request's result is published, so that a result is never lost to a crash (a request
        the checkpoint covers is not applied again after a restart, nor answered again)."""
        model = self.models.get(model_id)
        if model is None or not model.to_checkpoint:
            return
        self.trainer.save(self.root / "checkpoints", model_id, keep=2, suffix=f"-seq{model.stream_seq:012d}",
                          extra={STREAM_SEQ: model.stream_seq, SAMPLER_VERSION: model.sampler_version})
        model.checkpointed, model.to_checkpoint = model.stream_seq, False

    def checkpoint_dir(self, model_id: str) -> Path:
        return self.root / "checkpoints" / run_directory(model_id)
