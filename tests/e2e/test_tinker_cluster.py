"""The Tinker API through the services as processes (`policyloop up --tinker`, reduced to the
publisher, the tinker front, the one learner and the rollout replica that samples for the API),
driven by the official SDK: the learner is killed (SIGKILL) between forward_backward and
optim_step, restarted by the launcher, and the optim_step applies the gradients of that
forward_backward once; the saved sampler weights are sampled on the replica's engine."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import numpy as np
import pytest

from policyloop.cluster.catalogue import entry
from policyloop.cluster.local import LocalCluster
from policyloop.cluster.status import cluster_status

tinker = pytest.importorskip("tinker")

API_KEY = "tml-e2e"
TOKENS = [4, 5, 14, 6, 16, 7, 8]


async def healthy(cluster: LocalCluster, names: set[str], timeout_s: float = 240) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        status = await cluster_status(cluster.nats_url, cluster.redis_url, cluster.namespace)
        up = {i.instance for i in status.instances if i.healthy}
        if names <= up:
            return
        assert loop.time() < deadline, f"not healthy: {sorted(names - up)}"
        await asyncio.sleep(0.5)


@pytest.mark.timeout(600)
async def test_a_killed_tinker_learner_loses_no_accepted_request_and_applies_none_twice(
        tmp_path: Path, tiny_model_dir: Path, nats_server, redis_server,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = LocalCluster(tmp_path / "run", nats_url=nats_server.url, redis_url=redis_server.url,
                           services=(entry("publisher"), entry("tinker"), entry("learner")), tinker=True,
                           prometheus=False,
                           extra_env={"POLICYLOOP_MODEL_PATH": str(tiny_model_dir), "POLICYLOOP_API_KEY": API_KEY})
    cluster.start()
    try:
        await healthy(cluster, {"publisher-0", "tinker-0", "learner-0", "tinker-sampler-0"})
        monkeypatch.setenv("TINKER_BASE_URL", f"http://127.0.0.1:{cluster.process('tinker-0').ports['api']}")
        monkeypatch.setenv("TINKER_API_KEY", API_KEY)
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(TOKENS[:-1]),
                                   loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], dtype=np.int64),
                                                   "weights": np.ones(len(TOKENS) - 1, dtype=np.float32)})]

        def before_kill():  # type: ignore[no-untyped-def]
            client = tinker.ServiceClient()
            training = client.create_lora_training_client(base_model=tiny_model_dir.name, rank=4).result()
            loss = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
            return training, loss

        training, loss = await asyncio.to_thread(before_kill)
        learner = cluster.process("learner-0")
        learner.signal(signal.SIGKILL)
        await asyncio.to_thread(learner.proc.wait, 30)  # type: ignore[union-attr]
        assert cluster.supervise() == ["learner-0"]  # the launcher restarts it

        def after_restart():  # type: ignore[no-untyped-def]
            done = training.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
            again = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
            sampler = training.save_weights_and_get_sampling_client().result()
            sampled = sampler.sample(tinker.types.ModelInput.from_ints(TOKENS[:3]), 2,
                                     tinker.types.SamplingParams(max_tokens=3, temperature=1.0)).result()
            return done, again, sampled

        done, again, sampled = await asyncio.to_thread(after_restart)
    finally:
        cluster.stop()
    # The killed learner's gradients were recomputed from the stream, once: one call, one step.
    assert done.metrics["forward_backward_calls:sum"] == 1
    assert again < loss
    assert len(sampled.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) for s in sampled.sequences)
