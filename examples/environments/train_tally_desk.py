"""Train the chat model on the tally desk (policyloop/envs/programs/tally_desk.py), a stateful
environment written as a team would write one, on a running cluster:

    policyloop bootstrap --chat
    policyloop up --model-path ~/.cache/policyloop/models/chat-qwen2-small-<hash> &
    python examples/environments/train_tally_desk.py --gateway 127.0.0.1:<gateway grpc port>

It submits the desk (its code runs in a sandbox session per episode), starts a run and prints the
desk's mean reward as the learner trains: the first and the last quarter of the run's steps.
"""

from __future__ import annotations

import argparse
import json

import grpc

from policyloop.cluster.client import build_environment, read_program
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.envs.programs import TALLY_DESK, TALLY_DESK_ENTRY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", required=True, help="host:port of the gateway's gRPC LoopService")
    parser.add_argument("--tasks", type=int, default=400, help="episodes' groups to train on")
    parser.add_argument("--version", default="v1")
    args = parser.parse_args()

    tasks = [loop_pb2.TaskSpec(metadata={"seed": str(seed)}) for seed in range(1000)]
    env = build_environment("tally-desk", args.version, tasks, "environment_reward", group_size=8,
                            max_new_tokens=96, temperature=1.0, max_turns=3,
                            driver=read_program(TALLY_DESK, TALLY_DESK_ENTRY))
    with grpc.insecure_channel(args.gateway) as channel:
        loop = loop_pb2_grpc.LoopServiceStub(channel)
        submitted = loop.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env))
        run = loop.StartRun(loop_pb2.StartRunRequest(
            num_tasks=args.tasks, environments=[loop_pb2.EnvironmentMix(environment=submitted.environment, weight=1)]))
        print(f"run {run.run_id} on {submitted.environment}: {args.tasks} groups of 8 episodes")
        rewards: dict[int, float] = {}  # learner step -> the desk's mean reward over that step's samples
        for update in loop.WatchRun(loop_pb2.WatchRunRequest(run_id=run.run_id)):
            step = update.progress.learner_step
            progress = update.progress.environments.get(submitted.environment)
            if progress is not None and step and step not in rewards:
                rewards[step] = progress.last_step_reward
                print(f"step {step:4d}  reward {rewards[step]:+.3f}", flush=True)
    steps = sorted(rewards)
    quarter = max(1, len(steps) // 4)
    first = sum(rewards[s] for s in steps[:quarter]) / quarter
    last = sum(rewards[s] for s in steps[-quarter:]) / quarter
    print(json.dumps({"run": run.run_id, "state": loop_pb2.RunState.Name(update.state), "steps": len(steps),
                      "reward_first_quarter": round(first, 4), "reward_last_quarter": round(last, 4)}))


if __name__ == "__main__":
    main()
