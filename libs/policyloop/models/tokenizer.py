"""The character-level tokenizer of the bootstrap model.

One token per character, so the model sees every digit on its own (no BPE merges hiding the
carries of an addition), and a tiny vocabulary keeps the embedding small. It is a `tokenizers`
WordLevel model behind a pre-tokenizer that isolates every character, saved as a standard
Hugging Face tokenizer directory — the same files an SGLang engine reads. Load it with
`load_tokenizer(dir)`: transformers 5's `AutoTokenizer`, for a directory whose config.json says
qwen2, builds its own Qwen2Tokenizer from the vocabulary alone (byte-level BPE, no unknown
token), which drops spaces and every character outside the vocabulary without a word.

No special tokens are added on encode (no BOS): the prompt "12+34=" is exactly six ids whether
or not the caller passes `add_special_tokens`, so every component tokenizes a prompt the same
way. Characters outside the vocabulary map to "<unk>" instead of failing.

The markers of tool calls and their results (`<python>` … `</python>`, `<output>` … `</output>`)
and `<tools>`, which opens a prompt that offers tools, are added tokens: single ids that encode
and decode as themselves (not special, so decoding with skip_special_tokens keeps them), which
multi-turn episodes stop on (envs/tools.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from policyloop.envs.tools import MARKER_TOKENS, TOOLS_PROMPT_TOKEN

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK)
CHARACTERS: tuple[str, ...] = (*"0123456789", "+", "-", "=", " ")
TOOL_TOKENS: tuple[str, ...] = (*MARKER_TOKENS, TOOLS_PROMPT_TOKEN)
# ids are positions: <pad> 0, <eos> 1, <bos> 2, <unk> 3, "0".."9" 4..13, "+" 14, "-" 15, "=" 16, " " 17,
# then the tool tokens 18..22
VOCAB: dict[str, int] = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS, *TOOL_TOKENS))}
PAD_ID, EOS_ID, BOS_ID, UNK_ID = (VOCAB[t] for t in SPECIAL_TOKENS)
MODEL_MAX_LENGTH = 64
# tokenizer_config.json's class names for "exactly what tokenizer.json says" (transformers 4, 5).
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # join characters back without spaces between them
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    # "PreTrainedTokenizerFast" rather than v5's "TokenizersBackend" name: transformers 4.x
    # (what an SGLang image may pin) knows only the former, and v5 maps it to the latter.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD,
        "eos_token": EOS,
        "bos_token": BOS,
        "unk_token": UNK,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",  # generation pads prompts on the left
        "clean_up_tokenization_spaces": False,  # decoding must give back exactly the characters
    }


def save_tokenizer(directory: Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    special = {"pad_token": PAD, "eos_token": EOS, "bos_token": BOS, "unk_token": UNK}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_tokenizer(directory: str | Path) -> Any:
    """The Hugging Face tokenizer in `directory` as its tokenizer.json defines it: a directory that
    declares the generic fast class (as save_tokenizer writes) is loaded as that class, so no
    model-specific class replaces its pipeline; any other through AutoTokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(directory)
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    if declared in GENERIC_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(directory))


def unreadable_characters(tokenizer: Any, text: str) -> list[str]:
    """The pieces of `text` the model would not see, each once, in order: those the tokenizer
    maps to its unknown token, and characters no token covers (a tokenizer without an unknown
    token drops them). Nothing when the ids decode back to `text` exactly: then nothing was lost
    (this also spares a byte-level tokenizer whose offsets leave out the spaces)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets: each character on its own
        return [] if unk is None else [c for c in dict.fromkeys(text)
                                       if unk in tokenizer(c, add_special_tokens=False).input_ids]
    if tokenizer.decode(encoded.input_ids, skip_special_tokens=False) == text:
        return []
    covered = [False] * len(text)
    pieces: list[tuple[int, str]] = []
    for token_id, (start, end) in zip(encoded.input_ids, encoded.offset_mapping, strict=True):
        if token_id == unk and text[start:end] != tokenizer.unk_token:
            pieces.append((start, text[start:end]))
        covered[start:end] = [True] * (end - start)
    pieces += [(i, c) for i, c in enumerate(text) if not covered[i]]
    return list(dict.fromkeys(piece for _, piece in sorted(pieces) if piece))
