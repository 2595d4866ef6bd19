"""A LoRA run's versions from the learner to an engine, adapter tensors only: pushed to a real
publisher (gRPC on loopback) under the run's own name as exact XOR deltas, fetched and verified
by a replica's sync, written as a peft directory, loaded by the embedded engine, and sampled
with: the engine then decodes as the learner's adapter does."""

from __future__ import annotations

from pathlib import Path

import torch

from policyloop.engines.embedded import start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rl.lora import AdapterTrainer, LoraSpec, adapter_model_name, save_adapter_directory
from policyloop.rl.losses import loss_settings
from policyloop.rl.trainer import TrainerConfig
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from policyloop.weights.sync import sync_weights
from policyloop.weights.torch_io import to_tensor, weight_set
from tests.helpers import greedy_ids
from tests.integration.test_trainer import group

PROMPT = [4, 5, 14, 6, 16]


async def _announce(_: object) -> None:
    pass


async def test_a_runs_adapter_versions_reach_an_engine_as_deltas_and_sample_as_trained(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))
    trainer = AdapterTrainer(tiny_model_dir, TrainerConfig(lr=0.05, device="cpu", loss=loss_settings()))
    trainer.add_run("team/arith", spec)
    name = adapter_model_name("policy", "team/arith")
    assert name.startswith("policy.lora.team_arith-")

    publisher = WeightServicer(WeightLibrary(VersionStore(tmp_path / "store", retention=4), snapshot_every=4),
                               on_stored=_announce)
    server, port = await start_weight_server(publisher, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=60)
    engine = await start_engine(tiny_model_dir, max_batch=4, threads=1, weight_version="0")
    try:
        pusher = VersionPusher(client, name, run_id="team/arith")
        held, kinds, pushed = None, [], []
        for step in range(3):
            behaviour = [[-1.0, -1.0], [-1.2, -1.2]]
            trainer.step("team/arith", [group(f"t{step}", PROMPT, [[8, 1], [9, 1]], [1.0, 0.0], behaviour)] * 2)
            version = trainer.run("team/arith").version
            report = await pusher.push(weight_set(version, trainer.export_adapter("team/arith")), step + 1)
            pushed.append(report)
            held, synced = await sync_weights(client, name, held, version)
            kinds.append(synced.kind)
        assert [r.kind for r in pushed] == ["keyframe", "delta", "delta"] and kinds == ["keyframe", "delta", "delta"]
        assert pushed[-1].raw_bytes == sum(t.numel() * 4 for t in trainer.export_adapter("team/arith").values())
        assert held is not None and held.version == 3
        tensors = {k: to_tensor(t) for k, t in held.tensors.items()}
        for key, tensor in trainer.export_adapter("team/arith").items():
            assert torch.equal(tensors[key], tensor), key  # exact, every tensor verified by hash on the way

        directory = save_adapter_directory(tensors, spec, tmp_path / "adapter-v3")
        async with SGLangClient(engine.base_url, timeout_s=60, retries=0) as engine_client:
            await engine_client.load_lora_adapter("team/arith@3", str(directory))
            answer = await engine_client.generate(GenerateRequest(
                input_ids=PROMPT, rid="s1", lora_path="team/arith@3",
                sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)))
        trainer.model.eval()
        assert answer.output_ids == greedy_ids(trainer.model, PROMPT, 6)  # the learner's own adapter, active
    finally:
        await engine.stop()
        await client.close()
        await server.stop(None)
