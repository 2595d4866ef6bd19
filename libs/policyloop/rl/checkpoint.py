"""Learner checkpoints with torch.distributed.checkpoint.

A checkpoint is a directory `<root>/version-<v>/` holding the model and optimizer state as a
DCP checkpoint (a run can load it on another number of ranks) plus `trainer.json` (policy version,
steps taken, the LR schedule's position, the ids of the samples the most recent steps trained, and
what the learner adds: its LEDGER position). It is written to a temporary directory and renamed
into place, then `<root>/latest` is replaced atomically, so a crash while writing leaves the
previous checkpoint the one that is loaded. RNG states (torch CPU and CUDA, Python's random) are
saved per rank (`rng-<rank>.pt`).

Two ways to write one. `save_checkpoint` is collective and writes while the caller waits (every
rank its shards). The learner's way keeps the write off the step's path: `take_snapshot` copies
the state of one version between two steps (the full state gathered on rank 0, every rank's RNG;
the step loop waits only for that copy), `write_snapshot` writes the copy from any thread of rank
0 while training goes on, and `commit_checkpoint` puts it in place once its version is published.
`CheckpointCadence` says when the next one is due.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from policyloop.weights.store import fsync_dir

LATEST = "latest"
# A snapshot is written by rank 0 alone (no_dist), on purpose: DCP warns of it at every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


# A trainer's other model and its optimizer (PPO's critic), checkpointed with the policy.
Companion = tuple[torch.nn.Module, torch.optim.Optimizer]
COMPANION_KEYS = ("critic", "critic_optimizer")


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, critic: Companion | None,
                 options: StateDictOptions | None = None) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    tensors = {"model": model_state, "optimizer": optimizer_state}
    if critic is not None:
        tensors |= dict(zip(COMPANION_KEYS, get_state_dict(*critic, options=options), strict=True))
    return tensors


def save_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                    keep: int = 2, critic: Companion | None = None) -> Path:
    """Writes the checkpoint of `state.version` (collective: every rank calls it); the `keep`
    newest stay on disk. `critic`: PPO's value model and its optimizer, saved beside the policy."""
    root = Path(root)
    final = checkpoint_path(root, state.version)
    tmp = root / f".version-{state.version:09d}.tmp"
    if _is_leader():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_state_dicts(model, optimizer, critic), checkpoint_id=str(tmp))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(rng_states(), tmp / f"rng-{rank}.pt")
    _barrier()
    if _is_leader():
        _write_record(tmp, state, dist.get_world_size() if dist.is_initialized() else 1, critic is not None)
        commit_checkpoint(tmp, final, keep)
    _barrier()
    return final


def _write_record(tmp: Path, state: TrainerState, world_size: int, critic: bool) -> None:
    """`trainer.json`, the last file of a checkpoint (`latest_checkpoint` takes one without it
    as incomplete)."""
    record = {"version": state.version, "steps": state.steps, "trained_ids": state.trained_ids,
              "extra": state.extra, "scheduler": state.scheduler, "written_unix": time.time(),
              "world_size": world_size, "critic": critic}
    with open(tmp / "trainer.json", "w") as f:
        # dumps, not dump: json.dump streams through the pure-Python encoder, and the recent ids
        # (dedupe_steps lists of a step's ids) made it most of a write's CPU time.
        f.write(json.dumps(record))
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Snapshot:
    """A trainer's state at one version, copied off the live tensors: what a writer thread turns
    into a checkpoint while the next steps train."""

    state: TrainerState
    tensors: dict[str, Any]          # {"model": ..., "optimizer": ...[, "critic", ...]}: full, on the CPU, owned
    rngs: list[dict[str, Any]]       # every rank's RNG states, by rank

    @property
    def critic(self) -> bool:
        return COMPANION_KEYS[0] in self.tensors


def take_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                  critic: Companion | None = None) -> Snapshot | None:
    """Copies the state of `state.version` (collective: every rank calls it between the same two
    steps). Rank 0 gets the snapshot, the other ranks None."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dicts = _state_dicts(model, optimizer, critic, options)
    rngs: list[Any] = [rng_states()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] | None = [None] * dist.get_world_size() if _is_leader() else None
        dist.gather_object(rngs[0], gathered, dst=0)
        rngs = gathered or []
    if not _is_leader():
        return None
    # On one rank (and for the optimizer's step counts) the state dict holds the live tensors
    # themselves, which the next step changes in place: those are copied.
    pairs = [(model, optimizer)] + ([critic] if critic is not None else [])
    live = _storages([t for module, optim in pairs for t in (*module.parameters(), *module.buffers(), *(
        v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)))])
    tensors = _owned(state_dicts, live)
    return Snapshot(state=state, tensors=tensors, rngs=rngs)


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    return {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in tensors}


def _owned(value: Any, live: set[int]) -> Any:
    """`value` with every tensor that shares storage with a live one copied (others are already
    copies: gathered, or moved to the CPU); containers rebuilt, so nothing is shared."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.clone() if value.untyped_storage().data_ptr() in live else value
    if isinstance(value, dict):
        return {k: _owned(v, live) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_owned(v, live) for v in value)
    return value


def write_snapshot(root: Path, snapshot: Snapshot) -> Path:
    """Writes `snapshot` to a temporary directory under `root` and returns it; no collectives,
    so from any thread of rank 0. `commit_checkpoint(tmp, checkpoint_path(root, version), keep)`
    then puts it in place."""
    tmp = Path(root) / f".version-{snapshot.state.version:09d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dcp.save(snapshot.tensors, checkpoint_id=str(tmp), no_dist=True)
    for rank, rng in enumerate(snapshot.rngs):
        torch.save(rng, tmp / f"rng-{rank}.pt")
    _write_record(tmp, snapshot.state, len(snapshot.rngs), snapshot.critic)
    return tmp


def checkpoint_path(root: Path, version: int) -> Path:
    return Path(root) / f"version-{version:09d}"


@dataclass
class CheckpointCadence:
    """When the next checkpoint is due: `every` versions after the newest snapshot, or `every_s`
    seconds after it (0 turns either off). Times are the caller's clock (time.monotonic)."""

    every: int
    every_s: float
    version: int = 0        # of the newest snapshot (or the checkpoint resumed from)
    at: float = 0.0         # when it was taken

    def due(self, version: int, now: float) -> bool:
        if version <= self.version:
            return False
        return bool((self.every and version - self.version >= self.every)
                    or (self.every_s and now - self.at >= self.every_s))

    def taken(self, version: int, now: float) -> None:
        self.version, self.at = version, now


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


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    critic: Companion | None = None) -> TrainerState:
    """Restores model, optimizer and this rank's RNG from `directory` (collective), and `critic`
    when the checkpoint holds one (a checkpoint from before the critic: it keeps its fresh start)."""
    directory = Path(directory)
    record = json.loads((directory / "trainer.json").read_text())
    with_critic = critic if critic is not None and record.get("critic") else None
    loaded = _state_dicts(model, optimizer, with_critic)
    dcp.load(loaded, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    if with_critic is not None:
        set_state_dict(*with_critic, model_state_dict=loaded[COMPANION_KEYS[0]],
                       optim_state_dict=loaded[COMPANION_KEYS[1]])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = directory / f"rng-{rank}.pt"
    if rng.exists():  # a run resumed on more ranks than it was saved with starts their RNG fresh
        set_rng_states(torch.load(rng, weights_only=False))
    return TrainerState(version=int(record["version"]), steps=int(record["steps"]),
                        trained_ids=[list(ids) for ids in record["trained_ids"]], extra=dict(record.get("extra", {})),
                        scheduler=dict(record.get("scheduler", {})))
