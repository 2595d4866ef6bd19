"""Train the chat model on an OpenEnv environment server, driven with the official `openenv`
client, on a running cluster. The echo environment `openenv init` generates will do:

    pip install 'policyloop[openenv]'
    python -m openenv.cli init echo_env -o /tmp/openenv && cd /tmp/openenv
    # serve it for a group's 8 sessions at once: create_app(EchoEnvironment, EchoAction,
    # EchoObservation, env_name="echo_env", max_concurrent_envs=16) as app in echo_app.py, then
    python -m uvicorn echo_app:app --port 8000 &
    python examples/environments/train_openenv.py --gateway 127.0.0.1:<gateway grpc port> \
        --server http://127.0.0.1:8000 --action-field message --observation-field echoed_message

Each episode is a session of its own on the server; the model's prose is the action, the
observation comes back as a user message and the server's reward lands on the model's turn. It
prints the server's mean reward as the learner trains, then the first and the last quarter.
"""

from __future__ import annotations

import argparse

from policyloop.cluster.client import build_environment, train_and_print
from policyloop.contracts.v1 import bus_pb2, loop_pb2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", required=True, help="host:port of the gateway's gRPC LoopService")
    parser.add_argument("--server", required=True, help="the OpenEnv server's URL, as the rollout replicas reach it")
    parser.add_argument("--action-field", default="message", help="the action's text field")
    parser.add_argument("--observation-field", default="", help="the observation's field shown (empty: all)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=160, help="episodes' groups to train on")
    parser.add_argument("--version", default="v1")
    args = parser.parse_args()

    # What each reset is given: the seed (the server's environment keeps the arguments its reset takes).
    tasks = [loop_pb2.TaskSpec(metadata={"seed": str(seed)}) for seed in range(1000)]
    server = bus_pb2.OpenEnvServer(base_url=args.server, action_field=args.action_field,
                                   observation_field=args.observation_field)
    env = build_environment("openenv", args.version, tasks, "environment_reward", group_size=8, max_new_tokens=48,
                            temperature=1.0, max_turns=args.max_turns, driver=server)
    train_and_print(args.gateway, env, args.tasks)


if __name__ == "__main__":
    main()
