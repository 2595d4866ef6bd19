"""The bootstrap model: a tiny config builds in seconds into a standard HF directory that loads
offline, is cached, is deterministic, and a failed build leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.models import bootstrap as bootstrap_module
from policyloop.models.bootstrap import (
    BootstrapConfig,
    BootstrapError,
    bootstrap,
    bootstrap_dir,
    is_complete,
    read_record,
)

# Small enough to train in a second or two; target 0 accepts the first evaluation.
TINY = BootstrapConfig(name="tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, batch_size=16, max_steps=30, eval_every=10, eval_problems=32,
                       target_accuracy=0.0)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_builds_a_standard_directory_that_loads_offline(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bootstrap(TINY, tmp_path)
    assert path == tmp_path / f"tiny-{TINY.digest()}"
    assert path.stat().st_mode & 0o777 == 0o755  # the cache is shared, not private to the builder
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "bootstrap.json"} <= names
    record = read_record(path)
    assert record["steps"] == 10 and record["config"] == TINY.model_dump(mode="json")
    assert len(record["eval_problems"]) == 32 and record["seed"] == TINY.seed and record["seconds"] > 0

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert str(model.dtype) == "torch.float32"
    assert model.config.eos_token_id == tokenizer.eos_token_id == 1
    assert model.generation_config.eos_token_id == 1 and model.generation_config.pad_token_id == 0
    batch = tokenizer(["12+34=", "99+99="], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and out.shape[1] <= 6 + 4


def test_second_call_is_cached_and_force_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = bootstrap(TINY, tmp_path)
    record_mtime = (path / "bootstrap.json").stat().st_mtime_ns

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached model must not be rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(bootstrap_module, "build", no_training)
        assert bootstrap(TINY, tmp_path) == path
    assert (path / "bootstrap.json").stat().st_mtime_ns == record_mtime

    assert bootstrap(TINY, tmp_path, force=True) == path
    assert (path / "bootstrap.json").stat().st_mtime_ns != record_mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging or old copies left


def test_failed_build_leaves_no_directory(tmp_path: Path) -> None:
    impossible = TINY.model_copy(update={"target_accuracy": 1.0, "max_accuracy": 1.0, "max_steps": 3,
                                         "eval_every": 1})
    with pytest.raises(BootstrapError, match="did not reach"):
        bootstrap(impossible, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not is_complete(bootstrap_dir(impossible, tmp_path))


def test_incomplete_directory_is_rebuilt(tmp_path: Path) -> None:
    half = bootstrap_dir(TINY, tmp_path)
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    assert bootstrap(TINY, tmp_path) == half and is_complete(half)


def _weights_digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_deterministic_given_the_seed(tmp_path: Path) -> None:
    first = bootstrap(TINY, tmp_path / "a")
    second = bootstrap(TINY, tmp_path / "b")
    other_seed = bootstrap(TINY.model_copy(update={"seed": TINY.seed + 1}), tmp_path / "c")
    assert _weights_digest(first) == _weights_digest(second)
    assert _weights_digest(first) != _weights_digest(other_seed)
    assert read_record(first)["eval_problems"] == read_record(second)["eval_problems"]


def test_config_hash_names_the_directory() -> None:
    assert TINY.digest() == BootstrapConfig(**TINY.model_dump()).digest()
    assert TINY.digest() != TINY.model_copy(update={"seed": 5}).digest()
    assert bootstrap_dir(TINY, Path("/x")).parent == Path("/x")


def test_overshoot_replays_the_interval_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accuracy jumps from 0 (step 10) to 0.9 (step 20): the interval is replayed and the build
    stops at the first step inside the window."""
    trained: list[int] = []
    monkeypatch.setattr(bootstrap_module, "_train_step", lambda m, o, s, c, step: trained.append(step))
    monkeypatch.setattr(bootstrap_module, "evaluate",
                        lambda *a, **k: 0.0 if trained[-1] < 16 else 0.3 if trained[-1] < 18 else 0.9)
    config = TINY.model_copy(update={"target_accuracy": 0.2, "max_accuracy": 0.5})
    model = bootstrap_module.make_model(config)
    steps, accuracy, history = bootstrap_module.warm_up(model, config, [])
    assert (steps, accuracy) == (17, 0.3)
    assert [s for s, _ in history] == [10, 20, 11, 12, 13, 14, 15, 16, 17]
    assert trained == [*range(20), *range(10, 17)]


def test_cli_prints_json(tmp_path: Path) -> None:
    """The CLI builds the default config, so here it only reports an existing cache entry."""
    config = BootstrapConfig()
    fake = bootstrap_dir(config, tmp_path)
    fake.mkdir(parents=True)
    (fake / "bootstrap.json").write_text(json.dumps({"heldout_accuracy": 0.25, "steps": 7, "seconds": 1.5}))
    result = subprocess.run([sys.executable, "-m", "policyloop", "bootstrap", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=dict(os.environ), timeout=60)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == {"path": str(fake.resolve()), "heldout_accuracy": 0.25, "steps": 7, "seconds": 1.5,
                       "cached": True}


@pytest.mark.slow
def test_default_bootstrap_lands_in_the_window(tmp_path: Path) -> None:
    """The real default build (about 20 s on 2 cores): held-out accuracy low but clearly above 0."""
    path = bootstrap(BootstrapConfig(), tmp_path)
    record = read_record(path)
    assert 0.20 <= record["heldout_accuracy"] <= 0.50
    assert 0.15 <= record["report"]["greedy_accuracy"] <= 0.50
    assert record["report"]["sampled_format_rate_t1"] > 0.9  # sampling at T=1 stays well formed
    assert record["seconds"] < 120
