"""Train the chat model on the tally desk (policyloop/envs/programs/tally_desk.py), a stateful
environment written as a team would write one, on a running cluster:

    policyloop bootstrap --chat
    policyloop up --model-path ~/.cache/policyloop/models/chat-qwen2-small-<hash> &
    python examples/environments/train_tally_desk.py --gateway 127.0.0.1:<gateway grpc port>

It submits the desk (its code runs in a sandbox session per episode), starts a run and prints the
desk's mean reward as the learner trains, then the first and the last quarter of the run's steps.
"""

from __future__ import annotations

import argparse

from policyloop.cluster.client import build_environment, read_program, train_and_print
from policyloop.contracts.v1 import loop_pb2
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
    train_and_print(args.gateway, env, args.tasks)


if __name__ == "__main__":
    main()
