"""What the cluster's model can take, read from its Hugging Face directory, so the gateway can
refuse prompts that cannot fit (the engine would refuse them sample by sample)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Without the model's tokenizer a text prompt is counted as at least one token per this many
# UTF-8 bytes. No token of a BPE, unigram or character vocabulary covers that much, so the bound
# refuses no prompt that fits, and still refuses one that is far too long. (A word-level
# vocabulary that maps a whole unknown word to one token could beat it.)
MAX_BYTES_PER_TOKEN = 256
# config.json keys that give a model's context length, in the order Hugging Face models use them.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class ModelContext:
    """The context length, the vocabulary size, the end-of-sequence token and the tokenizer (None
    where `tokenizers` or tokenizer.json is missing: text is then counted by MAX_BYTES_PER_TOKEN)."""

    path: str
    context_tokens: int | None
    vocab_size: int | None
    tokenizer: Any | None = None
    eos_token_id: int | None = None

    @property
    def measure(self) -> str:
        return "the model's tokenizer" if self.tokenizer is not None else f"{MAX_BYTES_PER_TOKEN} bytes per token"

    def text_tokens(self, texts: Sequence[str], room: int) -> list[int]:
        """Each text's token count as the rollout will tokenize it (no special tokens), or a lower
        bound: exact where the tokenizer is loaded and the text may fit within `room`."""
        bounds = [-(-len(text.encode()) // MAX_BYTES_PER_TOKEN) for text in texts]
        if self.tokenizer is None:
            return bounds
        # Texts already too long by the byte bound are not tokenized (a 6 MB prompt costs nothing).
        maybe = [i for i, bound in enumerate(bounds) if bound <= room]
        for start in range(0, len(maybe), 4096):
            chunk = maybe[start:start + 4096]
            encoded = self.tokenizer.encode_batch([texts[i] for i in chunk], add_special_tokens=False)
            for i, encoding in zip(chunk, encoded, strict=True):
                bounds[i] = len(encoding.ids)
        return bounds


def load_model_context(path: Path) -> ModelContext:
    """Reads the context length and vocabulary from `path`/config.json and loads
    `path`/tokenizer.json with `tokenizers` where it can. Raises ValueError when config.json
    cannot be read."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model_path: cannot read {path / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"model_path: {path / 'config.json'} is not a JSON object")
    context = next((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    eos = config.get("eos_token_id")
    if isinstance(eos, list):  # models with several stop tokens list them; the first ends a turn
        eos = eos[0] if eos else None
    return ModelContext(str(path), context, vocab, _load_tokenizer(path / "tokenizer.json"),
                        eos if isinstance(eos, int) else None)


def _load_tokenizer(path: Path) -> Any | None:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the light image may lack it: prompts are then bounded by bytes
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - a missing or foreign tokenizer file: the byte bound still holds
        return None
