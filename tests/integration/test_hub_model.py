"""A base model named by its Hugging Face id, loaded end to end offline: the test fills a Hugging
Face cache itself (tests/hf_cache.py: the tiny model as commit `main`, a perturbed copy as `v2`)
under HF_HOME, with HF_HUB_OFFLINE=1, and the embedded engine serves the model by its id — as a
rollout replica starts it (models.resolve through runtime.model_directory, then the engine child
process), and as `python -m policyloop.engines.embedded --model-path <id>@<revision>` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.models.tokenizer import load_tokenizer
from policyloop.rollout.engine_process import engine_url_or_start, stop_engine, wait_for_engine
from policyloop.runtime import ServiceCannotStart, model_directory
from tests.hf_cache import cache_model, offline_cache
from tests.tiny_model import perturbed_copy

REPO_ID = "policyloop-test/tiny-qwen2"


@pytest.fixture
def hub(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The cache under HF_HOME=tmp_path/hf, offline, for this process and those it starts."""
    cache = offline_cache(monkeypatch, tmp_path / "hf")
    return {"main": cache_model(cache, REPO_ID, tiny_model_dir),
            "v2": cache_model(cache, REPO_ID, perturbed_copy(tiny_model_dir, tmp_path / "v2"), revision="v2")}


async def test_a_replica_serves_the_model_its_settings_name_by_id(hub: dict[str, Path]) -> None:
    """The rollout service's start: the name resolved once, the tokenizer and the engine child
    loaded from the snapshot."""
    model_dir = await model_directory(REPO_ID)
    assert model_dir == hub["main"]
    tokenizer = load_tokenizer(model_dir)
    url, proc = engine_url_or_start("", model_dir, max_batch=4, threads=1)
    try:
        async with SGLangClient(url, timeout_s=60) as client:
            await wait_for_engine(client, proc, 120)
            assert (await client.model_info()).model_path == str(hub["main"])
            result = await client.generate(GenerateRequest(
                input_ids=tokenizer.encode("12+34=", add_special_tokens=False),
                sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
            assert len(result.output_ids) == 4
    finally:
        await stop_engine(proc)


async def test_the_engine_takes_an_id_and_a_revision_itself(hub: dict[str, Path]) -> None:
    url, proc = engine_url_or_start("", f"{REPO_ID}@v2", max_batch=4, threads=1)  # type: ignore[arg-type]
    try:
        async with SGLangClient(url, timeout_s=60) as client:
            await wait_for_engine(client, proc, 120)
            assert (await client.model_info()).model_path == str(hub["v2"])
    finally:
        await stop_engine(proc)


async def test_a_model_missing_from_the_cache_stops_the_start_with_the_reason(hub: dict[str, Path]) -> None:
    with pytest.raises(ServiceCannotStart, match=f"^model_path: no directory {REPO_ID}@v3 here.*not in the cache"):
        await model_directory(f"{REPO_ID}@v3")
    engine = subprocess.run([sys.executable, "-m", "policyloop.engines.embedded", "--model-path", "nobody/nothing"],
                            capture_output=True, text=True, timeout=120)
    assert engine.returncode != 0
    assert "--model-path: no directory nobody/nothing here" in engine.stderr and "HF_HUB_OFFLINE" in engine.stderr
