"""LoRA adapters in the embedded engine (SGLang's /load_lora_adapter, /unload_lora_adapter and
/generate's lora_path), through the SGLang client: rows of different adapters decode in one batch
and each gets what its adapter alone gives, the base stays the base, and bad requests are refused
naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
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


def sent_as_tensors(adapter: Path) -> tuple[dict, bytes, dict[str, str]]:
    """A peft directory as /load_lora_adapter_from_tensors takes it: config, safetensors, checksums."""
    import json

    import safetensors.torch

    from policyloop.rl.lora import adapter_safetensors

    config = json.loads((adapter / "adapter_config.json").read_text())
    payload, checksums = adapter_safetensors(safetensors.torch.load_file(adapter / "adapter_model.safetensors"))
    return config, payload, checksums


async def test_an_adapter_sent_as_tensors_serves_as_the_same_adapter_loaded_from_its_directory(
        engine: EmbeddedEngine, tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    config, payload, checksums = sent_as_tensors(adapters["b"])
    async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as client:
        loaded = await client.load_lora_adapter_from_tensors("run-b@1", config, payload, checksums)
        assert loaded.loaded_adapters == {"run-b@1": "__tensor__"}
        await client.load_lora_adapter("from-disk", str(adapters["b"]))
        sent, read = await client.generate_batch([greedy("t1", "run-b@1"), greedy("t2", "from-disk")])
        assert sent.output_ids == read.output_ids == reference_greedy(tiny_model_dir, adapters["b"])
        # Loaded again under the same name, it replaces the old one (no checksums: not checked).
        config_a, payload_a, _ = sent_as_tensors(adapters["a"])
        await client.load_lora_adapter_from_tensors("run-b@1", config_a, payload_a)
        assert (await client.generate(greedy("t3", "run-b@1"))).output_ids == reference_greedy(
            tiny_model_dir, adapters["a"])


async def test_adapters_sent_as_tensors_are_checked_and_a_refusal_leaves_nothing_behind(
        engine: EmbeddedEngine, adapters: dict[str, Path]) -> None:
    import base64

    import safetensors.torch

    config, payload, checksums = sent_as_tensors(adapters["a"])
    tensors = safetensors.torch.load(payload)
    first = sorted(tensors)[0]
    async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as client:
        with pytest.raises(EngineError, match="serialized_named_tensors\\[0\\]: not a safetensors file"):
            await client.load_lora_adapter_from_tensors("x", config, payload[: len(payload) // 2])
        damaged = {**tensors, first: tensors[first] + 1}
        with pytest.raises(EngineError, match=f"expected_checksums: .* 1 differ \\['{first}'\\]"):
            await client.load_lora_adapter_from_tensors("x", config, safetensors.torch.save(damaged), checksums)
        fewer = {name: t for name, t in tensors.items() if name != first}
        with pytest.raises(EngineError, match="serialized_named_tensors: the adapter sent does not fit this model: "
                                              "missing 1 tensors"):
            await client.load_lora_adapter_from_tensors("x", config, safetensors.torch.save(fewer))
        with pytest.raises(EngineError, match="config_dict: the adapter sent asks for init_lora_weights='pissa'"):
            await client.load_lora_adapter_from_tensors("x", {**config, "init_lora_weights": "pissa"}, payload)
        with pytest.raises(EngineError, match="config_dict: not a peft adapter config"):
            await client.load_lora_adapter_from_tensors("x", {**config, "peft_type": "NOPE"}, payload)
        assert engine.served.lora is None and not engine.served.adapters  # nothing half-loaded

        # SGLang's own formats are pickles: refused unread, naming the field, as raw HTTP shows.
        body = {"lora_name": "x", "config_dict": config, "serialized_named_tensors": [
            base64.b64encode(b"\x80\x04pickle").decode()], "load_format": "flattened_bucket"}
        async with aiohttp.ClientSession() as http, \
                http.post(f"{engine.base_url}/load_lora_adapter_from_tensors", json=body) as answer:
            refusal = await answer.json()
        assert answer.status == 400 and not refusal["success"]
        assert refusal["error_message"].startswith("load_format: the embedded engine takes only 'safetensors'")


async def test_prompt_logprobs_are_those_of_the_model_with_the_adapter(
        engine: EmbeddedEngine, tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    """logprob_start_len (SGLang's input_token_logprobs): each prompt token's log-probability
    given those before it, from the base or an adapter, as a plain forward of the model gives."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def reference(adapter: Path | None) -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT])).logits[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(PROMPT[1:]).unsqueeze(-1)).squeeze(-1).tolist()

    async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as client:
        await client.load_lora_adapter("a", str(adapters["a"]))
        asked = greedy("p1").model_copy(update={"logprob_start_len": 0})
        base, adapted, later = await client.generate_batch([
            asked, asked.model_copy(update={"rid": "p2", "lora_path": "a"}),
            asked.model_copy(update={"rid": "p3", "logprob_start_len": 3})])
        assert base.input_logprobs[0] is None and base.input_logprobs[1:] == pytest.approx(reference(None), abs=1e-4)
        assert adapted.input_logprobs[1:] == pytest.approx(reference(adapters["a"]), abs=1e-4)
        assert later.input_logprobs[:3] == [None] * 3 and later.input_logprobs[3:] == base.input_logprobs[3:]
        assert (await client.generate(greedy("p4"))).input_logprobs is None  # not asked for
        with pytest.raises(EngineError, match="logprob_start_len: 5 is not a position"):
            await client.generate(asked.model_copy(update={"rid": "p5", "logprob_start_len": len(PROMPT)}))
