"""Train the chat model on a verifiers environment (verifiers/vf_second_try.py: a MultiTurnEnv and
its rubric, written as verifiers' authors write one), unchanged, on a running cluster:

    pip install 'policyloop[verifiers]'
    policyloop bootstrap --chat
    policyloop up --model-path ~/.cache/policyloop/models/chat-qwen2-small-<hash> &
    python examples/environments/train_verifiers.py --gateway 127.0.0.1:<gateway grpc port>

The environment's dataset rows are the tasks; each episode runs the environment's own rollout and
rubric in a sandbox session, a fork of one that loaded the environment once (`--environment vf-sums
--max-turns 1` for the single-turn one, `vf-adder-tools --max-turns 3` for the tool one). It prints
the rubric's mean reward as the learner trains, then the first and the last quarter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policyloop.cluster.client import build_environment, read_verifiers, train_and_print
from policyloop.envs.verifiers_env import dataset_tasks

HERE = Path(__file__).resolve().parent / "verifiers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", required=True, help="host:port of the gateway's gRPC LoopService")
    parser.add_argument("--environment", default="vf-second-try",
                        help="vf-second-try, vf-sums or vf-adder-tools (in verifiers/)")
    parser.add_argument("--max-turns", type=int, default=2, help="the environment's max_turns (tools: 3)")
    parser.add_argument("--tasks", type=int, default=160, help="episodes' groups to train on")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per task (a group)")
    parser.add_argument("--version", default="v1")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))  # where verifiers finds the environment here; the sessions get its file
    arguments = {"count": 1000}
    tasks, held_out = dataset_tasks(args.environment, arguments)
    source = HERE / f"{args.environment.replace('-', '_')}.py"
    env = build_environment(args.environment, args.version, tasks, "environment_reward", group_size=args.group_size,
                            max_new_tokens=64, temperature=1.0, max_turns=args.max_turns,
                            driver=read_verifiers(args.environment, source, arguments_json=json.dumps(arguments)))
    env.eval_tasks.extend(held_out)
    train_and_print(args.gateway, env, args.tasks)


if __name__ == "__main__":
    main()
