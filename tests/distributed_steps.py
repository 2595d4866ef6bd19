"""Run under torchrun by tests/integration/test_trainer.py: a few GRPO steps led by rank 0 and
followed by the other ranks; rank 0 writes the exported weights to argv[2]. argv[3]: the
advantages (gae: PPO with a critic, sharded and trained beside the policy)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.losses import loss_settings
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig


def step_groups(step: int) -> list[list[bus_pb2.Trajectory]]:
    """Deterministic groups of varied lengths and rewards (the same on every rank and run)."""
    g = torch.Generator().manual_seed(step)
    groups = []
    for task in range(3):
        prompt = [4 + task, 14, 5 + step % 5, 16]
        group = []
        for i in range(4):
            n = 1 + int(torch.randint(0, 4, (1,), generator=g))
            response = [int(x) for x in torch.randint(4, 14, (n,), generator=g)] + [1]
            group.append(bus_pb2.Trajectory(
                trajectory_id=f"s{step}t{task}/{i}", task_id=f"s{step}t{task}", group_id=f"s{step}t{task}",
                sample_index=i, group_size=4, prompt_token_ids=prompt, response_token_ids=response,
                behaviour_logprobs=[-2.5] * len(response), loss_mask=[True] * len(response),
                reward=float(torch.rand(1, generator=g)), scored=True, finish_reason=bus_pb2.FINISH_REASON_STOP,
            ))
        groups.append(group)
    return groups


def run(model_dir: Path, out: Path, advantages: str = "group", steps: int = 3) -> None:
    trainer = PolicyTrainer(model_dir, TrainerConfig(lr=1e-3, loss=loss_settings(advantages=advantages)), version=0)
    if trainer.rank != 0:
        trainer.follow()
        trainer.close()
        return
    reports = [trainer.step(step_groups(step)) for step in range(steps)]
    # The critic's gradient norm too (Adam's update hides a wrong scale of its gradient as well).
    norms = [n for r in reports for n in (r.grad_norm, *([r.statistics["critic_grad_norm"]]
                                                           if "critic_grad_norm" in r.statistics else []))]
    out.write_bytes(trainer.export_safetensors())
    # Adam hides a wrong gradient scale in the weights; the gradient norm does not.
    out.with_suffix(".norms").write_text(" ".join(repr(n) for n in norms))
    trainer.close()


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4], *[int(s) for s in sys.argv[4:5]])
    # Done and closed: leave without the interpreter's teardown, where a C++ thread of the process
    # group, still joinable, aborted one run in a few ("terminate called without an active
    # exception", SIGABRT) after the steps had been checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
