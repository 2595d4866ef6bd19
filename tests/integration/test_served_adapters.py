"""A replica's LoRA adapters (rollout.adapters.ServedAdapters) with a real publisher on loopback
gRPC and the embedded engine: each announced version of a served run is synced (a delta after the
first) and loaded under its own name; a request leases the newest name, and an older one is
unloaded once no request holds it; runs not served are never fetched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.adapters import ServedAdapters
from policyloop.engines.embedded import start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rl.lora import AdapterTrainer, LoraSpec, adapter_model_name, save_adapter_directory
from policyloop.rl.trainer import TrainerConfig
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from policyloop.weights.torch_io import weight_set
from tests.integration.test_trainer import group

SPEC = LoraSpec(rank=4, target_modules=("q_proj", "v_proj"))


async def _announce(_: object) -> None:
    pass


@pytest.mark.timeout(180)
async def test_a_replica_follows_the_adapters_of_the_runs_it_serves(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AdapterTrainer(tiny_model_dir, TrainerConfig(lr=0.05, device="cpu"))
    publisher = WeightServicer(WeightLibrary(VersionStore(tmp_path / "store", retention=4), snapshot_every=4),
                               on_stored=_announce)
    server, port = await start_weight_server(publisher, host="127.0.0.1", port=0)
    endpoint = f"127.0.0.1:{port}"
    client = WeightClient(endpoint, deadline_s=60)
    engine = await start_engine(tiny_model_dir, max_batch=4, threads=1, weight_version="0")
    fetched: list[str] = []

    class CountingClient(WeightClient):
        async def fetch(self, model: str, **kwargs):  # type: ignore[no-untyped-def, override]
            fetched.append(model)
            return await super().fetch(model, **kwargs)

    replica_client = CountingClient(endpoint, deadline_s=60)
    pushers = {}

    async def new_version(run_id: str) -> bus_pb2.WeightsPublished:
        behaviour = [[-1.0, -1.0], [-1.2, -1.2]]
        trainer.step(run_id, [group("t", [4, 5, 14, 6, 16], [[8, 1], [9, 1]], [1.0, 0.0], behaviour)] * 2)
        version = trainer.run(run_id).version
        await pushers[run_id].push(weight_set(version, trainer.export_adapter(run_id)), version)
        return bus_pb2.WeightsPublished(model=pushers[run_id].model, version=version, fetch_endpoint=endpoint)

    try:
        async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as engine_client:
            adapters = ServedAdapters(engine_client, tmp_path / "adapters", lambda _: replica_client)
            for run_id in ("a", "b", "other"):
                trainer.add_run(run_id, SPEC)
                pushers[run_id] = VersionPusher(client, adapter_model_name("policy", run_id))
            adapters.serve("a", SPEC, adapter_model_name("policy", "a"))
            adapters.serve("b", SPEC, adapter_model_name("policy", "b"))

            assert (await adapters.update("a", await new_version("a"))).kind == "keyframe"
            assert await adapters.update("other", await new_version("other")) is None  # not served: not fetched
            assert fetched == [adapter_model_name("policy", "a")]
            async with adapters.lease("a") as first:
                assert (first.name, first.version) == ("a@1", 1)
                answer = await engine_client.generate(GenerateRequest(
                    input_ids=[4, 5, 14], rid="r1", lora_path=first.name,
                    sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
                assert len(answer.output_ids) == 3
                report = await adapters.update("a", await new_version("a"))
                assert report is not None and report.kind == "delta"
                # A request still holds a@1: both are loaded; new requests get a@2.
                assert adapters.current("a").name == "a@2" and set(adapters.loaded) == {"a@1", "a@2"}
            assert set(adapters.loaded) == {"a@2"}  # the last lease on a@1 ended: unloaded
            assert await adapters.update("a", bus_pb2.WeightsPublished(
                model=adapter_model_name("policy", "a"), version=2, fetch_endpoint=endpoint)) is None  # had it

            await adapters.update("b", await new_version("b"))
            assert set(adapters.loaded) == {"a@2", "b@1"}
            await adapters.remove("b")
            assert set(adapters.loaded) == {"a@2"} and adapters.current("b") is None
            with pytest.raises(LookupError):
                async with adapters.lease("b"):
                    pass
            # The versions went to the engine as tensors (nothing written): it serves exactly the
            # trainer's adapter, as the same tensors loaded from a peft directory give.
            assert adapters.loaded == {"a@2": None} and not (tmp_path / "adapters").exists()
            directory = save_adapter_directory(trainer.export_adapter("a"), SPEC, tmp_path / "a-v2")
            info = await engine_client.load_lora_adapter("probe", str(directory))
            assert set(info.loaded_adapters) == {"a@2", "probe"}  # the engine holds what the replica says
            greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
            sent, read = [await engine_client.generate(GenerateRequest(input_ids=[4, 5, 14, 6], rid=f"g-{name}",
                                                                       lora_path=name, sampling_params=greedy,
                                                                       return_logprob=True))
                          for name in ("a@2", "probe")]
            assert sent.output_ids == read.output_ids and sent.output_logprobs == read.output_logprobs
    finally:
        await engine.stop()
        await asyncio.gather(client.close(), replica_client.close())
        await server.stop(None)
