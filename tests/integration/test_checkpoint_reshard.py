"""A learner checkpoint written on N ranks resumes on M ranks (torch.distributed.checkpoint
resharding), FSDP2 on CPU with gloo: 2 → 1 and 1 → 2, each against an uninterrupted run.

The processes run tests/checkpoint_steps.py: under torchrun for two ranks, plainly for one. Each
save/restore also writes a snapshot of the full (gathered) model and optimizer state, so the
resharding itself is checked bit for bit; the training that follows is checked against the
uninterrupted run within a tolerance, since another rank count sums gradients in another order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch

from policyloop.cluster.local import free_port

REPO = Path(__file__).resolve().parents[2]
STEPS, MORE_STEPS = 2, 2
# A changed reduction order moves the weights by ~1e-6 after two steps. The key projection's bias
# has (in exact arithmetic) a zero gradient — softmax ignores a shift common to all keys — so
# Adam's update there is driven by rounding residue and differs by a few 1e-6 between rank
# counts even without any checkpoint (the uninterrupted 1- and 2-rank runs differ as much; 1.03e-5
# was seen). Its bound stays ten times below what losing the optimizer state costs (> 1e-3 on
# every tensor, the control test below), so the check still fails when the restore is wrong.
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
ZERO_GRADIENT = {"rtol": 1e-5, "atol": 1e-4}


def run_steps(ranks: int, *args: str | Path, tmp: Path) -> None:
    module = ["-m", "tests.checkpoint_steps", *map(str, args)]
    if ranks == 1:
        command = [sys.executable, *module]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1",
                   f"--master_port={free_port()}", *module]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    assert result.returncode == 0, (f"{' '.join(command)} exited with {result.returncode}\n"
                                    f"files written under {tmp}: {written[:40]}\n"
                                    f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-6000:]}")


@dataclass
class Saved:
    ranks: int
    ckpt: Path
    snapshot: Path   # full model + optimizer state right after the save
    weights: Path    # exported after MORE_STEPS further steps in the same process (uninterrupted)


@dataclass
class Resumed:
    ranks: int
    snapshot: Path | None  # full model + optimizer state right after the restore
    weights: Path

    @property
    def summary(self) -> dict:
        return json.loads(self.weights.with_suffix(".json").read_text())


def save_run(model: Path, root: Path, ranks: int, *extra: str) -> Saved:
    root.mkdir(parents=True, exist_ok=True)
    saved = Saved(ranks, root / "ckpt", root / "saved.safetensors", root / "uninterrupted.safetensors")
    run_steps(ranks, "save", "--model", model, "--ckpt", saved.ckpt, "--steps", STEPS, "--more-steps", MORE_STEPS,
              "--out", saved.weights, "--snapshot", saved.snapshot, *extra, tmp=root)
    return saved


def resume_run(model: Path, saved: Saved, root: Path, ranks: int, fresh_optimizer: bool = False) -> Resumed:
    root.mkdir(parents=True, exist_ok=True)
    resumed = Resumed(ranks, None if fresh_optimizer else root / "restored.safetensors", root / "resumed.safetensors")
    extra = ["--fresh-optimizer"] if fresh_optimizer else ["--snapshot", str(resumed.snapshot)]
    run_steps(ranks, "resume", "--model", model, "--ckpt", saved.ckpt, "--more-steps", MORE_STEPS,
              "--out", resumed.weights, *extra, tmp=root)
    return resumed


@pytest.fixture(scope="module")
def saved_on_one(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Also the reference: STEPS + MORE_STEPS steps on one rank in one process."""
    return save_run(tiny_model_dir, tmp_path_factory.mktemp("saved-on-1"), 1)


@pytest.fixture(scope="module")
def saved_on_two(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save_run(tiny_model_dir, tmp_path_factory.mktemp("saved-on-2"), 2)


def load(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    different = [k for k in expected
                 if not torch.equal(actual[k].reshape(-1).view(torch.uint8), expected[k].reshape(-1).view(torch.uint8))]
    assert not different, f"not restored bit for bit: {different[:5]} (max abs diff {max_abs_diff(actual, expected)})"


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        tolerance = ZERO_GRADIENT if name.endswith("self_attn.k_proj.bias") else TIGHT
        torch.testing.assert_close(actual[name], expected[name], **tolerance,
                                   msg=lambda m, name=name: f"{name}: {m}")


def check_resumed(saved: Saved, resumed: Resumed, reference: Saved, base: Path) -> float:
    """The restore gave back exactly what was saved; the run then ends where the uninterrupted
    one did. Returns the largest weight difference from the reference."""
    summary = resumed.summary
    assert summary["restored"] == {"version": STEPS, "steps": STEPS, "trained_ids": [["a"]],
                                   "extra": {"ledger_seq": 3}, "saved_world_size": saved.ranks,
                                   "trainer_version": STEPS, "trainer_steps": STEPS}
    assert (summary["version"], summary["steps"], summary["world_size"]) == (STEPS + MORE_STEPS,
                                                                             STEPS + MORE_STEPS, resumed.ranks)
    with safetensors.safe_open(str(resumed.weights), framework="pt") as f:
        assert f.metadata()["policy_version"] == str(STEPS + MORE_STEPS)

    saved_state, restored_state = load(saved.snapshot), load(resumed.snapshot)  # type: ignore[arg-type]
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in saved_state)
    assert all(float(v) == STEPS for k, v in saved_state.items() if k.endswith("/step"))
    assert_bit_identical(restored_state, saved_state)
    base_weights = load(base / "model.safetensors")
    assert any(not torch.equal(saved_state[f"model/{k}"], base_weights[k]) for k in base_weights)

    actual, expected = load(resumed.weights), load(reference.weights)
    assert sorted(actual) == sorted(base_weights)
    assert_weights_close(actual, expected)
    return max_abs_diff(actual, expected)


def test_saved_on_two_ranks_resumes_on_one(tiny_model_dir: Path, saved_on_one: Saved, saved_on_two: Saved,
                                           tmp_path: Path) -> None:
    assert sorted(p.name for p in latest_dir(saved_on_two).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = resume_run(tiny_model_dir, saved_on_two, tmp_path / "resume-on-1", 1)
    diff = check_resumed(saved_on_two, resumed, saved_on_one, tiny_model_dir)
    # The same within the same tolerance of the uninterrupted two-rank run.
    assert_weights_close(load(resumed.weights), load(saved_on_two.weights))
    print(f"2 -> 1 ranks: max abs diff from the uninterrupted 1-rank run {diff:.3g}")


def test_saved_on_one_rank_resumes_on_two(tiny_model_dir: Path, saved_on_one: Saved, tmp_path: Path) -> None:
    assert sorted(p.name for p in latest_dir(saved_on_one).glob("*.distcp")) == ["__0_0.distcp"]
    resumed = resume_run(tiny_model_dir, saved_on_one, tmp_path / "resume-on-2", 2)
    diff = check_resumed(saved_on_one, resumed, saved_on_one, tiny_model_dir)
    print(f"1 -> 2 ranks: max abs diff from the uninterrupted 1-rank run {diff:.3g}")


def test_a_checkpoint_copied_between_steps_on_two_ranks_and_written_later_resumes_on_one(
        tiny_model_dir: Path, saved_on_one: Saved, tmp_path: Path) -> None:
    """The learner's way (rl.checkpoint.take_snapshot, then write_snapshot off the step's path):
    every rank copies its part between two steps, rank 0 writes the whole state alone once
    further steps changed the live one, and the restore gives back the copy bit for bit."""
    off_path = save_run(tiny_model_dir, tmp_path / "off-path-on-2", 2, "--off-path")
    assert sorted(p.name for p in latest_dir(off_path).glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
    resumed = resume_run(tiny_model_dir, off_path, tmp_path / "resume-on-1", 1)
    check_resumed(off_path, resumed, saved_on_one, tiny_model_dir)


def test_without_the_optimizer_state_the_resumed_run_ends_elsewhere(
        tiny_model_dir: Path, saved_on_one: Saved, saved_on_two: Saved, tmp_path: Path) -> None:
    """The control: the same resume with Adam's moments dropped after the restore lands far
    outside the tolerance — so the agreement above needs the optimizer state to come back."""
    control = resume_run(tiny_model_dir, saved_on_two, tmp_path / "fresh-optimizer", 1, fresh_optimizer=True)
    assert control.summary["version"] == STEPS + MORE_STEPS
    actual, expected = load(control.weights), load(saved_on_one.weights)
    far = [k for k in expected if float((actual[k] - expected[k]).abs().max()) > 1e-3]
    assert len(far) == len(expected), sorted(set(expected) - set(far))


def latest_dir(saved: Saved) -> Path:
    from policyloop.rl.checkpoint import latest_checkpoint

    directory = latest_checkpoint(saved.ckpt)
    assert directory is not None and directory.name == f"version-{STEPS:09d}"
    return directory
