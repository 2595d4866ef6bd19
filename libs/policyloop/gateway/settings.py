"""The gateway's settings (flags `--<field>`, env vars `POLICYLOOP_<FIELD>`)."""

from __future__ import annotations

from pydantic import Field

from policyloop.gateway.validation import MAX_ENVIRONMENT_BYTES
from policyloop.models.resolve import REF_HELP, ModelRef
from policyloop.runtime import ServiceSettings


class GatewaySettings(ServiceSettings):
    grpc_host: str = Field("127.0.0.1", description="Interface of the LoopService gRPC server.")
    grpc_port: int = Field(50051, description="Port of the LoopService gRPC server (0: any free port).")
    bearer_token: str = Field("", description="If set, every call must carry 'authorization: Bearer <token>'.")
    publisher_token: str = Field("", description="Bearer token for the publisher (PromoteVersion has it keep the "
                                                 "promoted version), if it wants one.")
    feeder_lease_s: float = Field(
        10.0, description="Lease on feeding one run; another replica takes over after it lapses."
    )
    backpressure_wait_s: float = Field(
        1.0, description="Pause before retrying when TASKS is full."
    )
    max_waiting_demonstrations: int = Field(
        4096, gt=0, description="Most demonstrations (supervised runs) fed to TRAJECTORIES and not yet taken by the "
                                "learner: feeding pauses above it (backpressure, as when TASKS is full), so that a "
                                "large SFT run never fills TRAJECTORIES.")
    watch_poll_s: float = Field(0.5, description="How often WatchRun looks for changes.")
    model_path: ModelRef | None = Field(
        None, description="The cluster's base model (its config.json and tokenizer.json): environments whose "
                          "prompts cannot fit its context with max_new_tokens are refused. Unset: prompts are not "
                          "checked against a model. " + REF_HELP)
    max_environment_bytes: int = Field(
        MAX_ENVIRONMENT_BYTES, gt=0, description="Largest environment (serialized) SubmitEnvironment or "
                                                 "UploadEnvironment accepts; an upload is refused as soon as it "
                                                 "goes past it.")
