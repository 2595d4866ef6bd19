"""The chat model's tokenizer: a byte-level BPE trained here, Qwen2's pipeline at a small scale.

Qwen2's normalizer (NFC) and pre-tokenizer (its split regex: words, single digits `\\p{N}`,
punctuation runs, newlines, spaces, then GPT-2's byte-to-unicode mapping, ByteLevel), BPE merges
trained with the `tokenizers` library on a corpus generated here (the warm-up's chat conversations
rendered with the chat template, plus English prose made up from word lists and a few lines of
other scripts, emoji and code: no downloads). Every byte is in the base alphabet, so any text
encodes without an unknown token and decodes back exactly as its NFC form, which is the text
itself for everything but decomposed accents (an "e" + combining acute comes back as "é").

Why NFC rather than no normalizer (which would give back every text byte for byte): transformers
5's AutoTokenizer, for a directory whose config.json says qwen2, always builds its Qwen2Tokenizer
from vocab and merges with Qwen2's own pipeline, NFC included, whatever tokenizer_config.json
declares. With the same pipeline in tokenizer.json, every loader gives the same ids for every
text: AutoTokenizer on the model directory, the generic fast class (transformers 4, an SGLang
image, `load_tokenizer`), and the raw `tokenizers.Tokenizer`.

The special tokens are chat_format's (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2); the
tool-call markup (`<tool_call>` …) is added as non-special tokens at the end of the vocabulary, so
each is one id and survives `skip_special_tokens`. No BOS; eos `<|im_end|>` (a turn's end), pad
`<|endoftext|>`.

`save_chat_tokenizer` writes a standard Hugging Face directory: tokenizer.json, vocab.json and
merges.txt, and a tokenizer_config.json declaring the generic fast class and carrying
chat_format.CHAT_TEMPLATE. Training takes a few seconds; the result is cached under the model
cache root, keyed by a hash of the corpus and the trainer settings, and in memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from policyloop.models.chat_format import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    IM_START,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
)
from policyloop.models.chat_tasks import render, tasks

# Qwen2's pre-tokenizer regex (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
VOCAB_SIZE = 2048
"""The whole vocabulary: 256 bytes, 3 special tokens, the merges, and the 4 markup tokens last."""
MODEL_MAX_LENGTH = 1024
EOS, PAD = IM_END, END_OF_TEXT
TOKENIZER_FILE = "tokenizer.json"
# Part of the cache key, beside the corpus and the pipeline: bump it when training changes.
TOKENIZER_FORMAT = 1
CORPUS_SEED = 20261128


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _untrained() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


# --- the corpus ---------------------------------------------------------------------------------

_NOUNS = """
time year people way day man woman child world life hand part place case week company system program question
work government number night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member law car city
community name president team minute idea kid body information school face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education foot boy
age policy process music market sense nation plan college interest death experience effect class control care field
development role effort rate heart drug show leader light voice wife police mind price report decision son view
relationship town road arm difference value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity star table need court oil
situation cost industry figure street image phone data picture practice piece land product doctor wall patient worker
news test movie north love support technology step baby computer type attention film tree source organization hair
window evidence population site garden river bridge mountain island village kitchen letter engine keyboard screen
journey island forest desert ocean planet library museum station airport hospital bakery factory harbour castle
""".split()
_VERBS = """
makes takes sees knows gets gives finds thinks tells becomes shows leaves feels brings begins keeps holds writes
stands hears lets means sets meets runs pays sits speaks lies leads reads grows loses falls sends builds
understands draws breaks spends cuts rises drives buys wears chooses seeks throws catches deals wins forgets
opens closes explains follows changes measures describes paints answers counts visits carries remembers watches
cleans fixes plans studies teaches learns shares moves plays helps starts finishes tries asks calls needs wants
""".split()
_ADJECTIVES = """
good new first last long great little own other old right big high different small large next early young important
few public bad same able late hard major better economic strong possible whole free military true federal
international full special easy clear recent certain personal open red difficult available likely short single
medical current wrong private past foreign fine common poor natural significant similar hot dead central happy
serious ready simple left physical general environmental financial blue democratic dark various entire close legal
religious cold final main green nice huge popular traditional cultural quiet bright gentle careful curious ancient
modern quick slow heavy light empty busy famous strange warm wooden golden silver narrow wide deep shallow
""".split()
_ADVERBS = """
slowly carefully again quickly quietly suddenly always never often sometimes usually rarely already almost
especially finally probably certainly clearly simply together early today tomorrow yesterday soon later
""".split()
_NAMES = """
Alice Bob Carol David Emma Frank Grace Henry Isabel Jack Karen Liam Maria Noah Olivia Peter Quinn Rachel Samuel
Tara Umar Victor Wendy Xavier Yara Zoe London Paris Berlin Tokyo Madrid Rome Cairo Lima Oslo Vienna Monday
Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July August September
October November December
""".split()
_CONNECTIVES = ("However,", "Then", "Later,", "Meanwhile,", "After that,", "Still,", "In the end,", "Because of this,",
                "On the other hand,", "For example,", "In fact,", "Of course,", "At first,", "Unfortunately,")
_PREPOSITIONS = ("in", "on", "at", "near", "behind", "under", "over", "after", "before", "with", "without",
                 "through", "across", "around", "between", "during", "for", "from", "into", "about")
_EXTRA = ("naïve café résumé", "Straße über", "数学很有趣。", "こんにちは、世界", "😀 🎉 👍", "α + β = γ",
          "100% sure — yes!", "e.g. x = 3.14, y = -2", "path/to/file.txt", "user@example.com",
          "def add(a, b):\n    return a + b\n", "for i in range(10):\n\tprint(i)\n", '{"key": [1, 2, 3]}',
          "Note: the values are 12, 345 and 6789.", "It's what they'd've wanted, isn't it?")


def _phrase(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS) + ("s" if rng.random() < 0.2 else "")
    if rng.random() < 0.5:
        noun = f"{rng.choice(_ADJECTIVES)} {noun}"
    return f"{rng.choice(('the', 'a', 'this', 'that', 'every', 'our', 'my', 'their', 'some'))} {noun}"


def _sentence(rng: random.Random) -> str:
    subject = rng.choice(_NAMES) if rng.random() < 0.3 else _phrase(rng)
    roll = rng.random()
    if roll < 0.12:
        text = f"{rng.choice(('Why', 'When', 'How often', 'Where'))} does {subject} {rng.choice(_VERBS)[:-1]} " \
               f"{_phrase(rng)}?"
        return text[0].upper() + text[1:]
    text = f"{subject} {rng.choice(_VERBS)} {_phrase(rng)}"
    if rng.random() < 0.5:
        text += f" {rng.choice(_PREPOSITIONS)} {_phrase(rng)}"
    if rng.random() < 0.4:
        text += f" {rng.choice(_ADVERBS)}"
    if rng.random() < 0.25:
        text = f"{rng.choice(_CONNECTIVES)} {text}"
    if rng.random() < 0.15:
        text += f", {rng.randint(0, 9999)} times"
    text = text[0].upper() + text[1:]
    return text + rng.choice((".", ".", ".", "!", ";"))


def _prose(rng: random.Random) -> str:
    paragraphs = [" ".join(_sentence(rng) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        paragraphs.append(rng.choice(_EXTRA))
    return "\n\n".join(paragraphs)


def corpus(seed: int = CORPUS_SEED, conversations: int = 3000, paragraphs: int = 6000) -> Iterator[str]:
    """The training text: warm-up conversations (text and tool ones) rendered with the chat
    template, then English paragraphs; deterministic in seed."""
    for task in tasks(conversations, seed, heldout=False, tool_fraction=0.5):
        yield render(task.conversation(), task.tools)
    rng = random.Random(seed)
    for _ in range(paragraphs):
        yield _prose(rng)


def _train(texts: list[str]) -> Tokenizer:
    tokenizer = _untrained()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(MARKUP_TOKENS), min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def _cache_dir() -> Path:
    from policyloop.models.bootstrap import default_cache_root  # late: bootstrap imports torch types only

    return default_cache_root() / "chat-tokenizer"


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    texts = list(corpus())
    recipe = {"format": TOKENIZER_FORMAT, "vocab_size": VOCAB_SIZE, "pipeline": _untrained().to_str(),
              "special": SPECIAL_TOKENS, "markup": MARKUP_TOKENS}
    key = hashlib.sha256(json.dumps(recipe).encode())
    for text in texts:
        key.update(text.encode())
        key.update(b"\0")
    cached = _cache_dir() / f"tokenizer-{key.hexdigest()[:16]}.json"
    if cached.is_file():
        return cached.read_text()
    text = _train(texts).to_str()
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{cached.name}.", dir=cached.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, cached)  # whole or absent, whoever wins a concurrent race
    return text


def build_chat_tokenizer() -> Tokenizer:
    """The trained chat tokenizer (trained on first use, then cached on disk and in memory)."""
    return Tokenizer.from_str(_trained_json())


def token_id(token: str) -> int:
    """The id of a special or markup token."""
    found = build_chat_tokenizer().token_to_id(token)
    if found is None:
        raise KeyError(token)
    return found


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    added = {str(i): {"content": t.content, "special": t.special, "normalized": False, "lstrip": False,
                      "rstrip": False, "single_word": False}
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    return {
        # the generic fast class (v4's name; v5 maps it to TokenizersBackend): tokenizer.json as it is
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_prefix_space": False,
        "errors": "replace",
    }


def save_chat_tokenizer(directory: Path) -> Path:
    """Writes tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.json and merges.txt
    into directory (created if missing); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = _trained_json()
    tokenizer = Tokenizer.from_str(text)
    (directory / TOKENIZER_FILE).write_text(text)
    (directory / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer), indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    model = json.loads(text)["model"]
    (directory / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False) + "\n")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return directory
