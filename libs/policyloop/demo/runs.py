"""`policyloop demo --runs N --lora-rank R`: N LoRA runs of the arithmetic task trained at once on
the demo's cluster (its learner and replica in the many-runs mode), each evaluated on the held-out
problems with its own newest adapter — fetched from the publisher as a replica would, loaded into
the engine under a name of its own, sampled with `lora_path`."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc, weights_pb2
from policyloop.rl.lora import adapter_model_name, save_adapter_directory
from policyloop.rl.settings import LoraSpec
from policyloop.weights.client import WeightClient
from policyloop.weights.sync import sync_weights
from policyloop.weights.torch_io import to_tensor

if TYPE_CHECKING:
    from policyloop.engines.sglang_client import SGLangClient
    from policyloop.state import VersionRegistry

@dataclass
class RunEvaluation:
    t: float
    version: int
    accuracy: float


@dataclass
class RunResult:
    run_id: str
    accuracy_before: float = 0.0
    accuracy_after: float = 0.0
    steps: int = 0                        # the run's adapter versions: one per learner step of the run
    adapter_bytes_per_version: int = 0    # median stored bytes of its versions after the first (deltas)
    adapter_raw_bytes: int = 0            # one version's adapter tensors
    evaluations: list[RunEvaluation] = field(default_factory=list)


def lora_spec(rank: int) -> loop_pb2.LoraSpec:
    return LoraSpec(rank=rank, alpha=2.0 * rank).to_proto()


async def start_lora_runs(stub: loop_pb2_grpc.LoopServiceStub, environment: str, count: int, rank: int,
                          seed: int) -> list[loop_pb2.Run]:
    """`count` LoRA runs of the environment, each with a task order of its own."""
    return [await stub.StartRun(loop_pb2.StartRunRequest(
        environments=[loop_pb2.EnvironmentMix(environment=environment, weight=1.0)], num_tasks=1_000_000,
        seed=seed + i, model="policy", lora=lora_spec(rank)), timeout=30) for i in range(count)]


async def run_versions(versions: VersionRegistry, runs: list[RunResult]) -> dict[str, int]:
    return {r.run_id: await versions.get(adapter_model_name("policy", r.run_id)) for r in runs}


class AdapterEvaluator:
    """Loads a run's newest adapter version into the engine (as a replica would: fetched and
    verified from the publisher) for an evaluation, and unloads it after."""

    def __init__(self, engine: SGLangClient, publisher_endpoint: str, spec: LoraSpec) -> None:
        self.engine, self.spec = engine, spec
        self.publisher = WeightClient(publisher_endpoint)
        self.root = Path(tempfile.mkdtemp(prefix="demo-adapters-"))
        self.raw_bytes: dict[str, int] = {}  # one version of each run's adapter, as last loaded

    async def load(self, run_id: str) -> tuple[str, int] | None:
        """(lora_path, version) of the run's newest adapter, loaded; None while it has none."""
        model = adapter_model_name("policy", run_id)
        listed = await self.publisher.list_versions(model)
        if not listed:
            return None
        newest = max(v.version for v in listed)
        weights, _ = await sync_weights(self.publisher, model, None, newest)
        self.raw_bytes[run_id] = weights.raw_bytes
        directory = save_adapter_directory({k: to_tensor(t) for k, t in weights.tensors.items()}, self.spec,
                                           self.root / f"{model}-{newest}")
        name = f"demo-eval/{run_id}@{newest}"
        await self.engine.load_lora_adapter(name, str(directory))
        return name, newest

    async def unload(self, name: str) -> None:
        await self.engine.unload_lora_adapter(name)

    async def bytes_per_version(self, run_id: str) -> tuple[int, int]:
        """(median stored bytes of the deltas, raw bytes of one version) of the run's adapter (the
        raw bytes as of its last `load`)."""
        listed = await self.publisher.list_versions(adapter_model_name("policy", run_id))
        deltas = [v.bytes for v in listed if v.kind == weights_pb2.PAYLOAD_KIND_DELTA]
        return (int(statistics.median(deltas)) if deltas else 0), self.raw_bytes.get(run_id, 0)

    async def close(self) -> None:
        await self.publisher.close()
        await asyncio.to_thread(shutil.rmtree, self.root, True)
