"""The evaluator's settings (flags `--<field>`, env vars `POLICYLOOP_<FIELD>`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from policyloop.envs.tool_episodes import ToolSettings
from policyloop.models.resolve import REF_HELP, ModelRef
from policyloop.runtime import ServiceSettings
from policyloop.scorers.settings import ModelScorerSettings


class EvaluatorSettings(ServiceSettings, ToolSettings, ModelScorerSettings):
    every_versions: int = Field(
        5, ge=1, description="Evaluate each version whose number is a multiple of this (1: every version). An "
                             "evaluator still busy when several such versions appeared evaluates the newest.")
    run_ends: bool = Field(
        True, description="Also evaluate each run's ends, whatever every_versions says: the version it started from "
                          "(its baseline) and its newest version once it ended (its result).")
    end_grace_s: float = Field(
        30.0, ge=0, description="After a run ends, how long its newest version is evaluated again as newer ones land "
                                "(samples generated before it stopped): its after-training result.")
    max_eval_tasks: int = Field(
        200, ge=0, description="Eval tasks scored per environment and version: the first this many of its "
                               "eval_tasks (0: all).")
    concurrency: int = Field(64, ge=1, description="Eval samples sent to the engine at once.")
    model_path: ModelRef = Field("model", description="The base policy (tokenizer, config, weights). " + REF_HELP)
    engine_url: str = Field(
        "", description="The evaluator's own engine (SGLang protocol): it serves only the version under evaluation. "
                        "Empty: an embedded engine started as a child process.")
    engine_max_batch: int = Field(64, ge=1, description="Most sequences the embedded engine decodes together.")
    engine_threads: int = Field(1, ge=1, description="torch threads of the embedded engine process.")
    engine_start_timeout_s: float = Field(120.0, description="How long the engine may take to answer /health.")
    generate_timeout_s: float = Field(300.0, description="Deadline of one eval sample.")
    weights_dir: Path = Field(Path("runs/local/evaluator-weights"),
                              description="Where the version under evaluation is written for the engine to load.")
    publisher_token: str = Field("", description="Bearer token for the publisher, if it wants one.")
    sandbox_timeout_s: float = Field(120.0, description="How long a code scorer's sandbox job may take.")
    promote: Literal["off", "rule"] = Field(
        "off", description="rule: promote each evaluated version that did not regress (and is a multiple of "
                           "promote_every) to the run's serving deployment; off: promotion by hand only.")
    promote_every: int = Field(0, ge=0, description="With promote=rule, promote only versions that are multiples "
                                                    "of this (0 or 1: every evaluated version that passes).")

    @property
    def adapter_source(self) -> Literal["tensors", "directory"]:
        """How a LoRA run's adapter versions reach the engine, as rollout replicas choose by default:
        in the request for the embedded engine, as a peft directory for SGLang."""
        return "directory" if self.engine_url else "tensors"
