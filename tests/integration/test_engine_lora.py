"""LoRA adapters in the embedded engine (SGLang's /load_lora_adapter, /unload_lora_adapter and
/generate's lora_path), through the SGLang client: rows of different adapters decode in one batch
and each gets what its adapter alone gives, the base stays the base, and bad requests are refused
naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import EngineError, SGLangClient
from tests.helpers import greedy_ids, make_lora_adapter, until

PROMPT = [4, 5, 14, 6, 16]
NEW_TOKENS = 6


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(tiny_model_dir, max_batch=8, threads=1, weight_version="0")
    yield running
    await running.stop()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_lora_adapter(tiny_model_dir, root / "a", seed=1),
            "b": make_lora_adapter(tiny_model_dir, root / "b", seed=2, rank=8, target_modules=("o_proj", "up_proj"))}


def greedy(rid: str, lora: str | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=PROMPT, rid=rid, lora_path=lora,
                           sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))


def reference_greedy(model_dir: Path, adapter: Path | None) -> list[int]:
    """Greedy decoding without a cache, on the model with the adapter merged in by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return greedy_ids(model, PROMPT, NEW_TOKENS)


async def test_rows_of_different_adapters_decode_together_as_each_alone(
        engine: EmbeddedEngine, tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as client:
        base_before = (await client.generate(greedy("base0"))).output_ids
        loaded = await client.load_lora_adapter("run-a@1", str(adapters["a"]))
        assert loaded.loaded_adapters == {"run-a@1": str(adapters["a"])}
        await client.load_lora_adapter("run-b@1", str(adapters["b"]))
        together = await client.generate_batch([greedy("a1", "run-a@1"), greedy("base1"), greedy("b1", "run-b@1"),
                                                greedy("a2", "run-a@1")])
        alone = {lora: (await client.generate(greedy(f"alone-{lora}", lora))).output_ids
                 for lora in ("run-a@1", "run-b@1", None)}
        assert [r.output_ids for r in together] == [alone["run-a@1"], alone[None], alone["run-b@1"],
                                                    alone["run-a@1"]]
        assert alone[None] == base_before == reference_greedy(tiny_model_dir, None)
        assert alone["run-a@1"] == reference_greedy(tiny_model_dir, adapters["a"])
        assert alone["run-b@1"] == reference_greedy(tiny_model_dir, adapters["b"])
        assert alone["run-a@1"] != alone[None] or alone["run-b@1"] != alone[None]  # the adapters do something

        # The base weights still update by name while adapters are loaded.
        await client.update_weights_from_disk(str(tiny_model_dir), weight_version="2")
        assert (await client.generate(greedy("a3", "run-a@1"))).output_ids == alone["run-a@1"]

        # Unloading frees an adapter; after the last, the model is the base as it was.
        assert (await client.unload_lora_adapter("run-a@1")).loaded_adapters == {"run-b@1": str(adapters["b"])}
        with pytest.raises(EngineError, match="lora_path"):
            await client.generate(greedy("a4", "run-a@1"))
        await client.unload_lora_adapter("run-b@1")
        assert engine.served.lora is None and (await client.generate(greedy("base2"))).output_ids == base_before


async def test_bad_adapter_requests_are_refused_naming_the_field(
        engine: EmbeddedEngine, tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as client:
        with pytest.raises(EngineError, match="lora_path: .* holds no peft adapter"):
            await client.load_lora_adapter("x", str(tmp_path / "missing"))
        with pytest.raises(EngineError, match="lora_name: no adapter named 'x' is loaded"):
            await client.unload_lora_adapter("x")
        with pytest.raises(EngineError, match="lora_path: no adapter named 'x' is loaded"):
            await client.generate(greedy("r1", "x"))
        assert engine.served.lora is None  # a failed load leaves nothing behind

        # An adapter a request samples with is neither replaced nor freed under it.
        await client.load_lora_adapter("a", str(adapters["a"]))
        await client.pause_generation("in_place")
        held = asyncio.create_task(client.generate(greedy("r2", "a")))
        await until(lambda: "r2" in engine.scheduler.requests, what="the request queued")
        with pytest.raises(EngineError, match="lora_name: adapter 'a' is in use by 1 requests"):
            await client.unload_lora_adapter("a")
        with pytest.raises(EngineError, match="in use"):
            await client.load_lora_adapter("a", str(adapters["b"]))
        await client.continue_generation()
        assert len((await held).output_ids) == NEW_TOKENS
        await client.unload_lora_adapter("a")
