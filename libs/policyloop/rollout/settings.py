"""The rollout replica's settings (`model`, `max_lag` and `groups_per_step` are the loop's
shared settings, runtime.settings.ServiceSettings)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from policyloop.envs.tool_episodes import ToolSettings
from policyloop.models.resolve import REF_HELP, ModelRef
from policyloop.runtime.settings import ServiceSettings
from policyloop.weights.settings import RelaySettings


class RolloutSettings(ServiceSettings, ToolSettings):
    role: Literal["training", "serving"] = Field(
        "training", description="training: sample Tasks for the learner, following each new version. serving: a "
                                "replica of a run's serving deployment — it follows only the run's promoted version "
                                "(serve_run; PROMOTIONS), takes no Tasks, and answers an OpenAI-compatible endpoint "
                                "(openai_host:openai_port) whose exchanges are recorded on TRACES.")
    serve_run: str = Field("", description="serving: the run whose promoted versions this replica serves.")
    served_model_name: str = Field("", description="serving: the model name callers pass (`model`); empty: serve_run.")
    openai_host: str = Field("127.0.0.1", description="serving: interface of the OpenAI-compatible endpoint.")
    openai_port: int = Field(8000, description="serving: port of the OpenAI-compatible endpoint (0: any free port).")
    concurrency: int = Field(
        0, ge=0, description="Tasks (groups) this replica samples at once; 0: groups_per_step, a step's batch at once "
                             "(the engine decodes what it holds together: few large batches cost far less than "
                             "many small ones).")
    model_path: ModelRef = Field("model", description="The base policy (tokenizer, config, weights). " + REF_HELP)
    engine: Literal["embedded", "sglang"] = Field("embedded", description="Which engine serves the policy.")
    engine_url: str = Field(
        "", description="Base URL of the engine's HTTP API; empty with engine=embedded starts one as a child process."
    )
    engine_max_batch: int = Field(
        256, ge=1, description="Most sequences the embedded engine decodes together (a step's samples by default: "
                               "groups_per_step 32 × group size 8).")
    engine_threads: int = Field(1, description="torch threads of the embedded engine process.")
    engine_start_timeout_s: float = Field(120.0, description="How long the engine may take to answer /health.")
    generate_timeout_s: float = Field(300.0, description="Deadline of one generate request.")
    weights_dir: Path = Field(
        Path("runs/local/rollout-weights"),
        description="Where fetched versions are written for the engine to load (one directory per version) when "
                    "they go to it as directories (weight_load).",
    )
    weight_load: Literal["directory", "tensors"] = Field(
        "directory", description="How a fetched, verified version reaches the engine: directory — written under "
                                 "weights_dir as a Hugging Face directory the engine loads (/update_weights_from_disk; "
                                 "the replica and the engine share that directory); tensors — sent in the request "
                                 "(/update_weights_from_tensor as one safetensors file, nothing written; the embedded "
                                 "engine only: SGLang's from-tensor route takes pickled tensors). Sending costs more "
                                 "CPU than writing: the file goes as base64 in JSON.")
    weight_activation: Literal["auto", "swap", "pause"] = Field(
        "auto", description="How the engine switches to a fetched version: swap — staged beside the served weights "
                            "while it goes on generating (/stage_weights_from_*), then swapped in between two decode "
                            "steps (/activate_staged_weights), so generation stands still only for the swap (the "
                            "embedded engine, in weight_update_mode in_place); pause — SGLang's pause → update → "
                            "continue, generation standing still while the weights are copied in. auto: swap where "
                            "it can, pause otherwise.")
    publisher_token: str = Field("", description="Bearer token for the publisher, if it wants one.")
    relay: RelaySettings = Field(default_factory=RelaySettings,
                                 description="Relayed fan-out: fetch versions from a parent replica and serve them "
                                             "to children (the publisher's tree.fanout places replicas).")
    weight_source: Literal["publisher", "colocated"] = Field(
        "publisher", description="publisher: fetch each version (a delta) and load it into the engine. colocated: "
                                 "the learner broadcasts it into the engine (its colocated_engines lists engine_url); "
                                 "the replica waits for the engine to report it, and fetches from the publisher "
                                 "only if that takes longer than colocated_wait_s.")
    colocated_wait_s: float = Field(30.0, description="How long a colocated replica waits for the broadcast.")
    weight_update_mode: Literal["in_place", "retract", "abort"] = Field(
        "in_place", description="How a new version reaches requests in flight (SGLang's pause modes around "
                                "update_weights_from_disk): in_place — paused between two steps, they go on with the "
                                "new weights and keep their KV cache; retract — the same, their cache recomputed with "
                                "the new weights; abort — they end, and the replica resubmits prompt + tokens so far "
                                "with the rest of the budget (partial rollouts). The cache is flushed only with abort "
                                "(SGLang cannot flush while requests are held).")
    max_resubmits: int = Field(8, description="Most resubmissions of one sample cut short by weight updates.")
    lora_runs: bool = Field(
        False, description="Serve LoRA runs, as a learner with lora_runs trains them: each task samples with its "
                           "run's newest adapter (loaded into the engine by version, rollout.adapters), its tokens "
                           "stamped with that adapter version, paced by the run's own versions. The base stays "
                           "as loaded: such a replica follows no full-model version.")
    tinker_sampling: bool = Field(
        False, description="Also sample the Tinker API's requests (TINKER_SAMPLES, put there by the tinker front): "
                           "with the base, or with the version of a Tinker model's adapter the sampling session "
                           "names, fetched from the publisher and loaded beside the base (tinker.sampling). Needs "
                           "lora_runs=true, whose base stays the base model.")
    tinker_adapters_kept: int = Field(4, ge=1, description="tinker_sampling: Tinker adapter versions kept loaded in "
                                                           "the engine (least recently used go first).")
    tinker_concurrency: int = Field(64, ge=1, description="tinker_sampling: sample requests sampled at once.")
    lora_load: Literal["auto", "tensors", "directory"] = Field(
        "auto", description="How a LoRA run's adapter versions reach the engine: tensors — sent in the request "
                            "(/load_lora_adapter_from_tensors as one safetensors file, sha256-checked by the "
                            "engine, nothing written to disk); directory — written under weights_dir as a peft "
                            "directory the engine loads (/load_lora_adapter). auto: tensors for the embedded "
                            "engine, directory for SGLang, whose from-tensors route takes pickled tensors only.")
    engine_health_interval_s: float = Field(
        2.0, description="How often the engine's /health is checked; the replica reports unhealthy while it fails, "
                         "and takes no new Task until it answers again.")
    engine_outage_wait_s: float = Field(
        600.0, description="How long a Task whose engine went away mid-sample waits (holding its message) for the "
                           "engine to answer again before it is handed back; an outage uses up none of its deliveries.")
    pacing_poll_s: float = Field(
        1.0, gt=0, description="A paced replica asks again for a slot when its engine takes a newer version, or "
                               "after this long.")

    def check_engine(self) -> None:
        """Refuses engine settings that cannot work, before anything starts."""
        if self.weight_source == "colocated" and not self.engine_url:
            raise ValueError("weight_source=colocated needs engine_url: the learner must reach the same engine")
        if self.tinker_sampling and not (self.lora_runs and self.role == "training"):
            raise ValueError("tinker_sampling needs lora_runs=true (and role=training): a replica that follows the "
                             "full model's versions holds the trained policy, not the base Tinker adapters train on")
        if self.role == "serving" and not self.serve_run:
            raise ValueError("role=serving needs serve_run: the run whose promoted versions it serves")
        if self.engine == "sglang" and self.weight_load == "tensors":
            raise ValueError("weight_load=tensors needs engine=embedded: SGLang's /update_weights_from_tensor takes "
                             "pickled tensors only (load versions from a directory)")
        if self.engine == "sglang" and not self.engine_url:
            raise ValueError("engine=sglang needs engine_url (the SGLang server's address, e.g. http://sglang:30000)")
        if self.weight_activation == "swap" and self.engine == "sglang":
            raise ValueError("weight_activation=swap needs engine=embedded: SGLang 0.5.23 has no route to stage a "
                             "version beside the served one (use pause)")
        if self.weight_activation == "swap" and self.weight_update_mode != "in_place":
            raise ValueError(f"weight_activation=swap needs weight_update_mode=in_place: {self.weight_update_mode} "
                             f"acts on the requests held at a pause, and a swap holds none")

    @property
    def activation(self) -> Literal["swap", "pause"]:
        """weight_activation resolved: auto is swap for the embedded engine in mode in_place."""
        if self.weight_activation != "auto":
            return self.weight_activation
        return "swap" if self.engine == "embedded" and self.weight_update_mode == "in_place" else "pause"

    @property
    def adapter_source(self) -> Literal["tensors", "directory"]:
        if self.lora_load != "auto":
            return self.lora_load
        return "tensors" if self.engine == "embedded" else "directory"

    @property
    def task_concurrency(self) -> int:
        return self.concurrency or self.groups_per_step
