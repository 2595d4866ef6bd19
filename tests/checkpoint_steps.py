"""Run by tests/integration/test_checkpoint_reshard.py, under torchrun (any number of ranks) or
alone (one rank): a learner checkpoint written on N ranks and resumed on M.

    save   --model M --ckpt ROOT --steps N [--more-steps K --out OUT] [--snapshot SNAP] [--off-path]
        N steps (step_groups(0..N-1)), then trainer.save(ROOT, ...); with --out, K further steps
        after the save and rank 0 writes the exported weights to OUT (the uninterrupted run).
        --off-path: checkpointed as the learner does instead, trainer.snapshot() on every rank,
        and rank 0 writes and commits the copy only after the K further steps changed the state.
    resume --model M --ckpt ROOT --more-steps K --out OUT [--snapshot SNAP] [--fresh-optimizer]
        trainer.restore(latest_checkpoint(ROOT)), K steps continuing the numbering, and rank 0
        writes the exported weights to OUT. --fresh-optimizer: every rank drops the optimizer's
        state right after the restore (the control run: Adam's moments and step count lost).

--snapshot: right after the save, the snapshot (or the restore) every rank joins in gathering the full model
and optimizer state, and rank 0 writes it to SNAP as safetensors ("model/<name>",
"optim/<name>/<exp_avg|exp_avg_sq|step>") — what the checkpoint held, and what came back.

Rank 0 leads (steps, save, restore, export); the other ranks run `follow()`, which calls the
same (hooked) `save`/`restore`. Next to OUT rank 0 writes OUT.json: the restored TrainerState,
the rank count the checkpoint was written on, and the final version, steps and world size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from policyloop.rl import checkpoint
from policyloop.rl.checkpoint import latest_checkpoint
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig
from tests.distributed_steps import step_groups

CONFIG = TrainerConfig(lr=3e-3)
TRAINED_IDS = [["a"]]
EXTRA = {"ledger_seq": 3}


def full_state(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state, gathered (collective); empty on ranks other than 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(trainer.model, options=options)
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    flat = {f"model/{k}": v for k, v in model.items()}
    for name, entry in optim.get("state", {}).items():
        for key, value in entry.items():
            flat[f"optim/{name}/{key}"] = torch.as_tensor(value)
    # Tied weights share storage; safetensors wants each tensor on its own.
    return {k: v.detach().clone().contiguous() for k, v in flat.items()}


def after(trainer: PolicyTrainer, method: str, then: Callable[[], None]) -> None:
    """Runs `then` on every rank right after `method` (follow() calls the hooked one too)."""
    original = getattr(trainer, method)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        then()
        return result

    setattr(trainer, method, hooked)


def write_snapshot(trainer: PolicyTrainer, path: Path) -> None:
    state = full_state(trainer)
    if trainer.rank == 0:
        safetensors.torch.save_file(state, str(path))


def write_result(trainer: PolicyTrainer, out: Path, summary: dict[str, Any]) -> None:
    tensors = trainer.export_tensors()  # collective; the full weights on rank 0
    safetensors.torch.save_file(tensors, str(out), metadata={"policy_version": str(trainer.version)})
    summary.update(version=trainer.version, steps=trainer.steps, world_size=trainer.world_size)
    out.with_suffix(".json").write_text(json.dumps(summary))


def save(args: argparse.Namespace) -> None:
    trainer = PolicyTrainer(args.model, CONFIG, version=0)
    if args.snapshot is not None:
        after(trainer, "snapshot" if args.off_path else "save", lambda: write_snapshot(trainer, args.snapshot))
    if trainer.rank != 0:
        trainer.follow()
        trainer.close()
        return
    try:
        for step in range(args.steps):
            trainer.step(step_groups(step))
        copy = trainer.snapshot(TRAINED_IDS, EXTRA) if args.off_path else None
        if not args.off_path:
            trainer.save(args.ckpt, trained_ids=TRAINED_IDS, extra=EXTRA)
        if args.out is not None:
            for step in range(args.steps, args.steps + args.more_steps):
                trainer.step(step_groups(step))
        if copy is not None:  # written while (here: after) later steps changed the live state
            written = checkpoint.write_snapshot(args.ckpt, copy)
            checkpoint.commit_checkpoint(written, checkpoint.checkpoint_path(args.ckpt, copy.state.version), 2)
        if args.out is not None:
            write_result(trainer, args.out, {})
    finally:
        trainer.close()


def resume(args: argparse.Namespace) -> None:
    trainer = PolicyTrainer(args.model, CONFIG, version=0)
    if args.snapshot is not None:
        after(trainer, "restore", lambda: write_snapshot(trainer, args.snapshot))
    if args.fresh_optimizer:
        # AdamW starts its moments afresh (late binding: loading the state replaced the dict).
        after(trainer, "restore", lambda: trainer.optimizer.state.clear())
    if trainer.rank != 0:
        trainer.follow()
        trainer.close()
        return
    try:
        directory = latest_checkpoint(args.ckpt)
        if directory is None:
            raise SystemExit(f"no complete checkpoint in {args.ckpt}")
        state = trainer.restore(directory)
        saved_on = json.loads((directory / "trainer.json").read_text())["world_size"]
        summary = {"restored": {"version": state.version, "steps": state.steps, "trained_ids": state.trained_ids,
                                "extra": state.extra, "saved_world_size": saved_on,
                                "trainer_version": trainer.version, "trainer_steps": trainer.steps}}
        for step in range(state.steps, state.steps + args.more_steps):
            trainer.step(step_groups(step))
        write_result(trainer, args.out, summary)
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--more-steps", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--snapshot", type=Path)
    parser.add_argument("--fresh-optimizer", action="store_true")
    parser.add_argument("--off-path", action="store_true")
    args = parser.parse_args()
    if args.mode == "resume" and args.out is None:
        parser.error("resume needs --out")
    save(args) if args.mode == "save" else resume(args)
    # Done, and the process group is destroyed: leave without the interpreter's finalization, where
    # gloo objects still alive can abort the process ("terminate called without an active
    # exception", seen once in CI) and fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
