"""Learner checkpoints with torch.distributed.checkpoint.

A checkpoint is a directory `<root>/version-<v>/` holding the model and optimizer state as a
DCP checkpoint (sharded: every rank writes its own part, and a run can load it on another
number of ranks) plus `trainer.json` (policy version, steps taken, the LR schedule's position, the
ids of the samples the most recent steps trained, and what the learner adds: its LEDGER position). It is written to
a temporary directory and renamed into place, then `<root>/latest` is replaced atomically, so a
crash while writing leaves the previous checkpoint the one that is loaded. RNG states (torch CPU
and CUDA, Python's random) are saved per rank (`rng-<rank>.pt`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from policyloop.weights.store import fsync_dir

LATEST = "latest"


@dataclass
class TrainerState:
    """What a learner must restore besides tensors."""

    version: int
    steps: int
    trained_ids: list[list[str]] = field(default_factory=list)  # per recent step, oldest first
    extra: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)     # the LR schedule's position


def rng_states() -> dict[str, Any]:
    """This process's random states: torch (CPU and every CUDA device) and Python's `random`."""
    states: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    if "python" in states:
        random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        # Resumed with fewer visible devices: the ones there are take their saved states.
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def _is_leader() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                    keep: int = 2) -> Path:
    """Writes the checkpoint of `state.version` (collective: every rank calls it); the `keep`
    newest stay on disk."""
    root = Path(root)
    final = root / f"version-{state.version:09d}"
    tmp = root / f".version-{state.version:09d}.tmp"
    if _is_leader():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(rng_states(), tmp / f"rng-{rank}.pt")
    _barrier()
    if _is_leader():
        record = {"version": state.version, "steps": state.steps, "trained_ids": state.trained_ids,
                  "extra": state.extra, "scheduler": state.scheduler, "written_unix": time.time(),
                  "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        with open(tmp / "trainer.json", "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        commit_checkpoint(tmp, final, keep)
    _barrier()
    return final


def commit_checkpoint(tmp: Path, final: Path, keep: int) -> None:
    """Makes the files written to `tmp` durable, renames it to `final`, points `latest` (in
    their parent) at it, and removes all but the `keep` newest `version-*` beside it."""
    root = final.parent
    for item in tmp.iterdir():  # the files are closed by now; make them durable too
        with open(item, "rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    older = [d for d in sorted(root.glob("version-*")) if d != final]
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path, record: str = "trainer.json") -> Path | None:
    """The directory `latest` names, if it is complete (holds its `record`, written last)."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    directory = Path(root) / pointer.read_text().strip()
    return directory if (directory / record).exists() else None


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restores model, optimizer and this rank's RNG from `directory` (collective)."""
    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = directory / f"rng-{rank}.pt"
    if rng.exists():  # a run resumed on more ranks than it was saved with starts their RNG fresh
        set_rng_states(torch.load(rng, weights_only=False))
    record = json.loads((directory / "trainer.json").read_text())
    return TrainerState(version=int(record["version"]), steps=int(record["steps"]),
                        trained_ids=[list(ids) for ids in record["trained_ids"]], extra=dict(record.get("extra", {})),
                        scheduler=dict(record.get("scheduler", {})))
