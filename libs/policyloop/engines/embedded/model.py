"""The model the embedded engine serves: a Hugging Face causal-LM directory loaded with
transformers in float32, what the engine needs to know of it (EOS ids, pad id, vocabulary,
context length), its version label, the LoRA adapters loaded beside it (peft), and one forward
pass with the KV cache, each row with its own adapter or none."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from policyloop.engines.protocol import GenerateRequest, ModelInfo, RequestError, SamplingParams
from policyloop.telemetry.logging import get_logger

log = get_logger("policyloop.engines.embedded")
# peft's name for "no adapter" in a batch whose rows choose their adapter.
BASE_ADAPTER = "__base__"
TENSOR_SOURCE = "__tensor__"  # the path SGLang reports for an adapter loaded from tensors
CLASSIFIER_SUFFIX = "ForSequenceClassification"  # the architectures served on /classify


def sent_tensors(copies: Sequence[bytes], expected_checksums: dict[str, str] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The tensors of a request's serialized_named_tensors (/load_lora_adapter_from_tensors,
    /update_weights_from_tensor: one safetensors file per TP rank; this engine has one), checked
    against expected_checksums (name -> sha256 of the tensor's raw bytes, as SGLang checks them)
    when given; RequestError naming the field."""
    import hashlib

    import safetensors.torch

    if len(copies) != 1:
        raise RequestError("serialized_named_tensors", f"the embedded engine has one rank: send one copy, "
                                                       f"got {len(copies)}")
    try:
        tensors = safetensors.torch.load(copies[0])
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for damaged bytes
        raise RequestError("serialized_named_tensors[0]", f"not a safetensors file: {exc}") from None
    if expected_checksums is not None:
        def sha256(tensor: torch.Tensor) -> str:
            return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

        wrong = sorted(n for n, want in expected_checksums.items() if n in tensors and sha256(tensors[n]) != want)
        missing = sorted(set(expected_checksums) - set(tensors))
        extra = sorted(set(tensors) - set(expected_checksums))
        if wrong or missing or extra:
            raise RequestError("expected_checksums", f"the tensors sent do not match: {len(wrong)} differ "
                                                     f"{wrong[:3]}, {len(missing)} missing {missing[:3]}, "
                                                     f"{len(extra)} not expected {extra[:3]}")
    return tensors


class ServedModel:
    """Loaded by `load()` on the compute thread; every method that touches the weights runs there."""

    def __init__(self, model_path: str | Path, *, threads: int, weight_version: str, device: str = "cpu") -> None:
        from policyloop.common.device import resolve_device

        self.model_path = str(model_path)
        # Where the weights and the KV cache live; inputs go there and logits come back to the CPU.
        self.device = torch.device(resolve_device(device))
        self.threads = threads
        self.weight_version = str(weight_version)
        self.model: Any = None
        self.tokenizer: Any = None
        self.eos_ids: frozenset[int] = frozenset()
        self.pad_id = 0
        self.vocab_size = 0
        self.max_context: int | None = None
        self.lora: Any = None  # the peft model around `model`, once an adapter is loaded
        self.adapters: dict[str, str] = {}  # loaded adapters: name -> the directory it came from
        # Their names inside peft (which takes no '.' in a name: SGLang's lora_name may hold any).
        self.adapter_ids: dict[str, str] = {}
        self._made = 0
        self.is_generation = True  # False: a sequence-classification (reward) model, served on /classify
        self.staged: Any = None  # a version staged beside the served one (weight_loading.StagedWeights)

    def load(self) -> None:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        from policyloop.models.resolve import resolve_model
        from policyloop.models.tokenizer import load_tokenizer

        # A Hugging Face model id: its snapshot in the Hugging Face cache (a directory: itself).
        self.model_path = str(resolve_model(self.model_path))
        torch.set_num_threads(self.threads)
        transformers.utils.logging.disable_progress_bar()
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        architectures = AutoConfig.from_pretrained(self.model_path, local_files_only=True).architectures or []
        # A reward model (SGLang serves it with --is-embedding): scores on /classify, no generation.
        self.is_generation = not any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures)
        loader = AutoModelForCausalLM if self.is_generation else AutoModelForSequenceClassification
        model = loader.from_pretrained(self.model_path, local_files_only=True, **{dtype_kw: torch.float32})
        model.to(self.device)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except Exception as exc:  # ids in, ids out still works; `text` prompts do not
            log.warning("engine_no_tokenizer", model_path=self.model_path, error=str(exc))
            self.tokenizer = None
        eos: set[int] = set()
        for source in (model.config, getattr(model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, list | tuple):
                eos.update(int(v) for v in value)
        self.eos_ids = frozenset(eos)
        pad = getattr(self.tokenizer, "pad_token_id", None) or getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_context = getattr(model.config, "max_position_embeddings", None)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The served base tensors by name (tied ones appear under each of their names); with
        adapters loaded, under the base checkpoint's names still, the adapters' own left out."""
        state = self.model.state_dict()
        if self.lora is None:
            return state
        return {name.replace(".base_layer.", "."): t for name, t in state.items() if ".lora_" not in name}

    def parameter_objects(self) -> dict[str, torch.nn.Parameter]:
        """The served base parameters themselves, under parameters()'s names (tied ones under each
        name, one object): what a staged version's tensors are swapped into."""
        named = self.model.named_parameters(remove_duplicate=False)
        if self.lora is None:
            return dict(named)
        return {name.replace(".base_layer.", "."): p for name, p in named if ".lora_" not in name}

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: Any, adapters: Sequence[str | None] = ()) -> tuple[torch.Tensor, Any]:
        """The next-token logits of every row, and the grown cache. `adapters`: each row's LoRA
        adapter (None: the base); rows of different adapters go through one forward."""
        kwargs: dict[str, Any] = {}
        model = self.model
        if self.lora is not None:
            model = self.lora
            kwargs["adapter_names"] = [self._peft_name(a) for a in adapters] if adapters else \
                [BASE_ADAPTER] * input_ids.shape[0]
        device = self.device
        out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1].float().cpu(), out.past_key_values

    def prompt_logprobs(self, input_ids: list[int], adapter: str | None = None) -> list[float]:
        """The log-probability of each prompt token after the first, given the tokens before it
        (SGLang's input_token_logprobs): one forward over the whole prompt, without a cache."""
        model, kwargs = self.model, {}
        if self.lora is not None:
            model, kwargs = self.lora, {"adapter_names": [self._peft_name(adapter)]}
        ids = torch.tensor([input_ids], dtype=torch.long)
        with torch.inference_mode():
            logits = model(input_ids=ids.to(self.device), use_cache=False, **kwargs).logits[0, :-1].float().cpu()
            chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        return chosen.tolist()

    def load_adapter(self, name: str, path: str) -> None:
        """Loads the peft LoRA adapter in directory `path` under `name` (replacing one of that
        name); RequestError naming lora_path when it is not an adapter this model can take."""
        from peft import PeftConfig

        try:
            config = PeftConfig.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - peft raises ValueError/OSError/JSON errors alike
            raise RequestError("lora_path", f"{path} holds no peft adapter: {exc}") from None

        def attach(internal: str) -> None:
            from peft import PeftModel

            if self.lora is None:
                self.lora = PeftModel.from_pretrained(self.model, path, adapter_name=internal, is_trainable=False)
            else:
                self.lora.load_adapter(path, adapter_name=internal, is_trainable=False)

        self._attach(name, config, attach, "lora_path", f"the adapter in {path}")
        self.adapters[name] = path

    def load_adapter_tensors(self, name: str, config_dict: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Loads a LoRA adapter given as its adapter_config.json and its tensors (named as peft
        saves them) under `name`; RequestError naming the field that does not fit. Every tensor
        of the adapter must be given, and no other."""
        from peft import PeftConfig

        try:
            config = PeftConfig.from_peft_type(**config_dict)
        except Exception as exc:  # noqa: BLE001 - unknown peft_type, bad or unknown config fields
            raise RequestError("config_dict", f"not a peft adapter config: {exc}") from None

        def attach(internal: str) -> None:
            from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

            if self.lora is None:
                self.lora = PeftModel(self.model, config, adapter_name=internal)
            else:
                self.lora.add_adapter(internal, config)
            expected = set(get_peft_model_state_dict(self.lora, adapter_name=internal))
            if set(tensors) != expected:
                missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
                raise ValueError(f"missing {len(missing)} tensors {missing[:3]}, unexpected {len(extra)} {extra[:3]}")
            set_peft_model_state_dict(self.lora, tensors, adapter_name=internal)

        self._attach(name, config, attach, "serialized_named_tensors", "the adapter sent")
        self.adapters[name] = TENSOR_SOURCE

    def _attach(self, name: str, config: Any, attach: Callable[[str], None], field: str, what: str) -> None:
        """Runs `attach` (which adds adapter `name` to self.lora) after the checks common to
        both sources; a failure leaves the adapters loaded before as they were."""
        config_field = "config_dict" if field != "lora_path" else field
        if getattr(config, "peft_type", None) != "LORA":
            raise RequestError(config_field, f"{what} is a {config.peft_type} adapter, not LoRA")
        # Initialisations that rewrite the base weights (PiSSA, OLoRA, LoftQ, ...) or import
        # modules by name would change what every other adapter and the base serve.
        if getattr(config, "init_lora_weights", True) not in (True, False, "gaussian"):
            raise RequestError(config_field, f"{what} asks for init_lora_weights={config.init_lora_weights!r}, "
                                             f"which rewrites the shared base weights: only true, false or "
                                             f"'gaussian' are taken")
        if getattr(config, "megatron_config", None):
            raise RequestError(config_field, f"{what} sets megatron_config, which this engine does not take")
        if name in self.adapters:
            self.unload_adapter(name)
        internal = f"adapter{self._made}"
        self._made += 1
        try:
            attach(internal)
        except Exception as exc:  # noqa: BLE001 - shapes or module names that do not fit this model
            if self.lora is not None and internal in self.lora.peft_config:
                self.lora.delete_adapter(internal)
            if not self.adapters and self.lora is not None:
                self.model, self.lora = self.lora.unload(), None
            raise RequestError(field, f"{what} does not fit this model: {exc}") from None
        self.lora.eval()
        self.adapter_ids[name] = internal

    def _peft_name(self, adapter: str | None) -> str:
        return BASE_ADAPTER if adapter is None else self.adapter_ids[adapter]

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise RequestError("lora_name", f"no adapter named {name!r} is loaded")
        del self.adapters[name]
        internal = self.adapter_ids.pop(name)
        if self.adapters:
            self.lora.delete_adapter(internal)
        else:  # the last one: the base model as it was, without LoRA layers
            self.model, self.lora = self.lora.unload(), None

    def info(self) -> ModelInfo:
        config = self.model.config
        return ModelInfo(model_path=self.model_path, tokenizer_path=self.model_path,
                         weight_version=self.weight_version, model_type=getattr(config, "model_type", None),
                         architectures=getattr(config, "architectures", None), is_generation=self.is_generation)

    def classify(self, prompts: Sequence[list[int]], max_batch: int) -> list[list[float]]:
        """The scores (one per label) of each prompt, `max_batch` prompts per forward (right-padded:
        the classification head reads each row's last token that is not padding)."""
        pad = self.model.config.pad_token_id
        if pad is None:  # the head cannot tell padding from the prompt: one prompt per forward
            max_batch, pad = 1, 0
        scores: list[list[float]] = []
        with torch.inference_mode():
            for start in range(0, len(prompts), max_batch):
                rows = prompts[start:start + max_batch]
                width = max(len(r) for r in rows)
                ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
                mask = (torch.arange(width) < torch.tensor([[len(r)] for r in rows])).long()
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                logits = logits.float().cpu()
                scores.extend(logits.tolist())
        return scores

    # -- a request's prompt and budget, checked against the model -------------------------------

    def prompt_ids(self, parsed: GenerateRequest) -> list[int]:
        return self.token_ids(parsed.text if parsed.text is not None else list(parsed.input_ids or []))

    def token_ids(self, prompt: str | list[int], where: str = "") -> list[int]:
        """A prompt's token ids (a text tokenized, ids checked against the vocabulary); RequestError
        naming the field (`where`: a batch entry's index, "[3]")."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"text{where}", "this engine has no tokenizer: send input_ids")
            ids = list(self.tokenizer(prompt)["input_ids"])
            if not ids:
                raise RequestError(f"text{where}", "the prompt is empty")
            return ids
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"input_ids{where}",
                               f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def classified_ids(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """The token ids of a /classify request's prompts, each within the model's context."""
        batch = len(prompts) > 1
        rows = []
        for i, prompt in enumerate(prompts):
            ids = self.token_ids(prompt, f"[{i}]" if batch else "")
            if self.max_context is not None and len(ids) > self.max_context:
                field = "text" if isinstance(prompt, str) else "input_ids"
                raise RequestError(f"{field}[{i}]" if batch else field,
                                   f"{len(ids)} tokens, more than the model's context length of {self.max_context}")
            rows.append(ids)
        return rows

    def max_new_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        room = None if self.max_context is None else self.max_context - prompt_len
        if room is not None and room < 0:
            raise RequestError("input_ids", f"the prompt has {prompt_len} tokens, more than the model's context "
                                            f"length of {self.max_context}")
        if params.max_new_tokens is None:
            return room if room is not None else 1 << 30
        if room is not None and params.max_new_tokens > room:
            raise RequestError("sampling_params.max_new_tokens",
                               f"{prompt_len} prompt tokens + {params.max_new_tokens} new tokens exceed the model's "
                               f"context length of {self.max_context}")
        return params.max_new_tokens

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
