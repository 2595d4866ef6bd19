"""Train the chat model on an OpenEnv environment server, driven with the official `openenv`
client, on a running cluster. openenv/sums_quiz.py is one, written as OpenEnv's authors write them
(a sums quiz with a second try):

    pip install 'policyloop[openenv]'
    (cd examples/environments/openenv && python -m uvicorn sums_quiz:app --port 8000) &
    python examples/environments/train_openenv.py --gateway 127.0.0.1:<gateway grpc port> \
        --server http://127.0.0.1:8000

Each episode is a session of its own on the server, reset with the task's seed; the model's prose
is the action's text field, each observation comes back as a user message and the server's reward
lands on the model's turn. Another server: name its fields (`openenv init`'s echo environment:
`--action-field message --observation-field echoed_message`). It prints the server's mean reward
as the learner trains, then the first and the last quarter.
"""

from __future__ import annotations

import argparse

from policyloop.cluster.client import build_environment, train_and_print
from policyloop.contracts.v1 import bus_pb2, loop_pb2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", required=True, help="host:port of the gateway's gRPC LoopService")
    parser.add_argument("--server", required=True, help="the OpenEnv server's URL, as the rollout replicas reach it")
    parser.add_argument("--action-field", default="answer", help="the action's text field")
    parser.add_argument("--observation-field", default="message", help="the observation's field shown (empty: all)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=160, help="episodes' groups to train on")
    parser.add_argument("--name", default="sums-quiz", help="the environment's name on the cluster")
    parser.add_argument("--version", default="v1")
    args = parser.parse_args()

    # What each reset is given: the seed (the server's environment keeps the arguments its reset takes).
    tasks = [loop_pb2.TaskSpec(metadata={"seed": str(seed)}) for seed in range(1000)]
    server = bus_pb2.OpenEnvServer(base_url=args.server, action_field=args.action_field,
                                   observation_field=args.observation_field)
    env = build_environment(args.name, args.version, tasks, "environment_reward", group_size=8, max_new_tokens=48,
                            temperature=1.0, max_turns=args.max_turns, driver=server)
    train_and_print(args.gateway, env, args.tasks)


if __name__ == "__main__":
    main()
