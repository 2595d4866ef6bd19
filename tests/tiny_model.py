"""A tiny, randomly initialised Qwen2 causal LM on the project's character tokenizer, written as
a standard Hugging Face model directory (config.json, model.safetensors, tokenizer files) that
`AutoModelForCausalLM` / `AutoTokenizer` load offline — what the embedded engine, the learner
and an SGLang server read. Reused by every test that needs a real model.

    build_tiny_model(dir)                       # seed 0: the same weights every time
    perturbed_copy(dir, other, scale=0.05)      # same architecture, different weights
    build_tiny_model(dir, hidden_size=32)       # a different shape (for mismatch tests)

`initializer_range` is larger than a trained model's so that the next-token distributions are
peaked enough for greedy decoding to produce varied, non-trivial outputs.
"""

from __future__ import annotations

from pathlib import Path

from policyloop.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB, save_tokenizer

VOCAB_SIZE = len(VOCAB)


def tiny_config(hidden_size: int = 64, num_layers: int = 2, initializer_range: float = 0.2,
                max_position_embeddings: int = 256):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        tie_word_embeddings=True, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID,
        architectures=["Qwen2ForCausalLM"],
    )


def build_tiny_model(directory: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     initializer_range: float = 0.2) -> Path:
    """Writes the model and tokenizer into `directory` (created) and returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(hidden_size, num_layers, initializer_range),
                                             dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory


def perturbed_copy(source: Path, directory: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """A copy of the model in `source` with Gaussian noise of std `scale` added to every weight."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory


def build_tiny_reward_model(directory: Path, seed: int = 0, max_position_embeddings: int = 256) -> Path:
    """A tiny random Qwen2 sequence classifier with one label (a reward model's shape: what
    SGLang serves on /classify) on the project's tokenizer, written into `directory`."""
    import torch
    from transformers import AutoModelForSequenceClassification

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_config(max_position_embeddings=max_position_embeddings)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory


def reward_model_scores(model_dir: Path, texts: list[str]) -> list[float]:
    """Each text's score under the reward model in `model_dir`, from an unpadded forward of it
    alone (what an engine's batched /classify must give)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from policyloop.models.tokenizer import build_tokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = build_tokenizer()
    with torch.inference_mode():
        return [float(model(input_ids=torch.tensor([tokenizer.encode(t).ids])).logits[0, 0]) for t in texts]
