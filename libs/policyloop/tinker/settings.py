"""The Tinker API service's settings (flags `--<field>`, env vars `POLICYLOOP_<FIELD>`). Sampling runs on
rollout replicas (RolloutSettings.tinker_sampling): the front holds no engine."""

from __future__ import annotations

from pydantic import Field

from policyloop.models.resolve import REF_HELP, ModelRef, model_label
from policyloop.runtime import ServiceSettings


class TinkerSettings(ServiceSettings):
    api_host: str = Field("127.0.0.1", description="Interface of the Tinker HTTP API.")
    api_port: int = Field(8088, description="Port of the Tinker HTTP API (0: any free port); TINKER_BASE_URL is "
                                            "http://<host>:<port>.")
    api_key: str = Field(
        "", description="The key every request must carry in X-API-Key (the SDK's TINKER_API_KEY; the SDK itself "
                        "wants keys that start with 'tml-'). Empty: any key.")
    base_model: str = Field(
        "", description="The name clients use for the cluster's base model (base_model of create_lora_training_client"
                        "); empty: model_path's Hugging Face model id (also where model_path is a snapshot in the "
                        "Hugging Face cache), else the name of its directory.")
    model_path: ModelRef = Field("model", description="The base model (its name and tokenizer; the front loads no "
                                                   "weights). " + REF_HELP)
    tokenizer_id: str = Field(
        "", description="What get_info names as the tokenizer: the SDK's get_tokenizer() loads it with "
                        "AutoTokenizer.from_pretrained (a hub id, or a directory the clients can read); empty: "
                        "model_path's Hugging Face model id, else its directory.")
    poll_s: float = Field(25.0, gt=0, description="How long retrieve_future waits for a result before answering "
                                                  "try_again (the SDK waits 45 s).")
    order_wait_s: float = Field(
        30.0, gt=0, description="How long a model's request waits for an earlier seq_id that has not arrived "
                                "(the SDK spends a seq_id on a request that fails in the client).")

    def model_name(self) -> str:
        return self.base_model or model_label(self.model_path)
