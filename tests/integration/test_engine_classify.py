"""The embedded engine serving a reward model (a sequence-classification directory) on SGLang's
/classify, over real HTTP on loopback and through SGLangClient: each prompt's score is the one an
unpadded forward of it alone gives, whatever batch it came in; a generative engine and a reward
model's engine refuse each other's routes; bad bodies get SGLang's refusal naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.sglang_client import EngineError, SGLangClient
from policyloop.models.tokenizer import VOCAB, build_tokenizer
from tests.tiny_model import build_tiny_reward_model, reward_model_scores

TEXTS = ["12+34=46", "12+34=47", "9+9=18", "5+5=", "99+1=100x"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"), max_position_embeddings=32)


@pytest.fixture
async def engine(reward_model: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(reward_model, max_batch=3, threads=1)
    yield running
    await running.stop()


async def post(url: str, payload: object) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as response:
        return response.status, await response.json(content_type=None)


async def test_scores_are_each_prompts_own_in_any_batch(engine: EmbeddedEngine, reward_model: Path) -> None:
    expected = reward_model_scores(reward_model, TEXTS)
    async with SGLangClient(engine.base_url, timeout_s=30, retries=0) as client:
        info = await client.model_info()
        assert info.is_generation is False and info.architectures == ["Qwen2ForSequenceClassification"]
        # 5 prompts over batches of max_batch 3 (different padding), by text and by token ids.
        by_text = await client.classify(TEXTS, rids=[f"r{i}" for i in range(len(TEXTS))])
        assert [r.rid for r in by_text] == [f"r{i}" for i in range(len(TEXTS))]
        tokenizer = build_tokenizer()
        by_ids = await client.classify([tokenizer.encode(t).ids for t in TEXTS])
        # Concurrent requests share the compute thread and answer each their own.
        singles = await asyncio.gather(*(client.classify([t]) for t in TEXTS))
    for got in ([r.score for r in by_text], [r.score for r in by_ids], [s[0].score for s in singles]):
        assert got == pytest.approx(expected, abs=1e-5)
    assert [r.prompt_tokens for r in by_text] == [len(t) for t in TEXTS]
    assert len(set(round(s, 6) for s in expected)) == len(TEXTS)  # a real model tells them apart
    # One prompt (not the batch form) is answered with one object, as SGLang does.
    status, body = await post(engine.base_url + "/classify", {"text": TEXTS[0], "rid": "one"})
    assert status == 200 and body["meta_info"]["id"] == "one"
    assert body["embedding"] == pytest.approx([expected[0]], abs=1e-5)
    status, page = 0, ""
    async with aiohttp.ClientSession() as session, session.get(engine.base_url + "/metrics") as response:
        status, page = response.status, await response.text()
    assert status == 200 and f"policyloop_engine_classified_prompts_total {float(3 * len(TEXTS) + 1)}" in page


async def test_refusals_name_the_field(engine: EmbeddedEngine, tiny_model_dir: Path) -> None:
    url = engine.base_url + "/classify"
    cases = [
        ({"text": "1+1=2", "input_ids": [4]}, 400, "input_ids"),
        ({"input_ids": [[4, 5], [4, 99]]}, 400, "input_ids[1]"),
        ({"text": ["1+1=2", "9" * 40]}, 400, "text[1]"),
        ({"text": []}, 400, "empty batch"),
        ({"text": ["1", 2]}, 422, "prompt 1"),
        ({"text": ["1", "2"], "rid": "a"}, 400, "rid"),
        ({"text": "1+1=2", "lora_path": "x"}, 400, "lora_path"),
        ({"text": "1+1=2", "no_such_field": 1}, 400, "no_such_field"),
    ]
    for body, status, named in cases:
        got, answer = await post(url, body)
        assert got == status and named in str(answer), (body, got, answer)
    got, answer = await post(engine.base_url + "/generate", {"input_ids": [VOCAB["1"]]})
    assert got == 400 and "/classify" in str(answer)
    async with SGLangClient(engine.base_url, timeout_s=30, retries=0) as client:
        with pytest.raises(EngineError, match="input_ids\\[1\\]"):
            await client.classify([[4, 5], [4, 99]])
    generative = await start_engine(tiny_model_dir, max_batch=2, threads=1)
    try:
        got, answer = await post(generative.base_url + "/classify", {"text": "1+1=2"})
        assert got == 400 and "sequence-classification" in str(answer)
    finally:
        await generative.stop()
