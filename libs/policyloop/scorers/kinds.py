"""The scorer kinds, declared once: each kind's name, what it rewards, and where it runs — in the
reward service's process (a pure function of the trajectory), as a sandbox job (user code), or on
a model the scoring service calls (`served`: built from its settings, which say where the model is).

The contract carries a kind as a field of the `scorer` oneof of Scorer and Environment (a
built-in verifier as a BuiltinVerifier.Kind); a test holds this table, the contract, the reward
service's registry and docs/environments.md's list to one another. The CLI's `--scorer` choices
and help, the gateway's and the bus validator's messages derive from the table or the contract."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.judge import judge_scorer
from policyloop.scorers.reward_code import reward_code_job, reward_code_score
from policyloop.scorers.reward_model import reward_model_scorer
from policyloop.scorers.sandboxed import CodeJob
from policyloop.scorers.score import Score, TrajectoryScorer, UnscorableTrajectory, scorer_kind
from policyloop.scorers.settings import ScorerContext
from policyloop.scorers.unit_tests import unit_test_job, unit_test_score
from policyloop.scorers.verifiers import Verifier, environment_reward, exact_answer, numeric_tolerance, regex

BuildJob = Callable[[bus_pb2.Trajectory], CodeJob]
ReadResult = Callable[[bus_pb2.Trajectory, CodeJob, bus_pb2.SandboxResult], Score]
BuildServed = Callable[[ScorerContext], TrajectoryScorer]


@dataclass(frozen=True)
class ScorerKind:
    name: str                                          # scorer_kind()'s: the registry key
    rewards: str                                       # what it rewards, for people
    verify: Verifier | None = None                     # runs in the reward service's process
    sandboxed: tuple[BuildJob, ReadResult] | None = None  # runs as a sandbox job: (build, read its result)
    served: BuildServed | None = None                  # calls a model: its scorer, built from the service's context

    @property
    def builtin(self) -> int | None:
        """Its BuiltinVerifier.Kind, when it is a built-in verifier."""
        value = bus_pb2.BuiltinVerifier.Kind.DESCRIPTOR.values_by_name.get(f"KIND_{self.name.upper()}")
        return None if value is None else value.number

    @property
    def field(self) -> str:
        """The `scorer` oneof field that carries it."""
        return "builtin" if self.builtin is not None else self.name


SCORER_KINDS: tuple[ScorerKind, ...] = (
    ScorerKind("exact_answer", "the completion equals the task's answer (in the answer's format, when the "
                               "environment gives one as the pattern)", verify=exact_answer),
    ScorerKind("numeric_tolerance", "a number within the tolerance of the task's answer", verify=numeric_tolerance),
    ScorerKind("regex", "the completion matches the pattern whole", verify=regex),
    ScorerKind("unit_tests", "the share of unit tests the completion passes, run in the sandbox",
               sandboxed=(unit_test_job, unit_test_score)),
    ScorerKind("reward_code", "your reward(prompt, completion, metadata), run in the sandbox",
               sandboxed=(reward_code_job, reward_code_score)),
    ScorerKind("environment_reward", "the rewards an environment that drives its episodes (a program, an "
                                     "OpenEnv server, a verifiers environment) gives its steps",
               verify=environment_reward),
    ScorerKind("reward_model", "a reward model's score of the prompt and response (served on engines' /classify; "
                               "optionally sigmoid-normalised, scaled and shifted)", served=reward_model_scorer),
    ScorerKind("judge", "an LLM judge's verdict (a number, a label or a JSON field) on the prompt and response, "
                        "from an OpenAI-compatible endpoint", served=judge_scorer),
)
SCORERS: dict[str, ScorerKind] = {kind.name: kind for kind in SCORER_KINDS}
VERIFIERS: dict[str, Verifier] = {kind.name: kind.verify for kind in SCORER_KINDS if kind.verify is not None}
SANDBOXED: dict[str, tuple[BuildJob, ReadResult]] = {
    kind.name: kind.sandboxed for kind in SCORER_KINDS if kind.sandboxed is not None}
SERVED: dict[str, BuildServed] = {kind.name: kind.served for kind in SCORER_KINDS if kind.served is not None}


def field_choices() -> str:
    """The `scorer` fields to choose from, for people: "builtin (exact_answer, ...), unit_tests, ..."."""
    fields: dict[str, list[str]] = {}
    for kind in SCORER_KINDS:
        fields.setdefault(kind.field, []).append(kind.name)
    named = [f"{field} ({', '.join(names)})" if field == "builtin" else field for field, names in fields.items()]
    return ", ".join(named[:-1]) + " or " + named[-1]


def verify(traj: bus_pb2.Trajectory) -> Score:
    """(reward, breakdown) of a trajectory whose scorer runs in this process."""
    kind = scorer_kind(traj.scorer)
    if kind not in VERIFIERS:
        raise UnscorableTrajectory(f"scorer: {kind or 'none'!r} is not a built-in verifier")
    return VERIFIERS[kind](traj)
