"""The engines on the learner's node that take each version by broadcast."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from policyloop.engines.sglang_client import EngineError, SGLangClient
from policyloop.learner.settings import ColocatedSettings
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import WEIGHT_SYNC_SECONDS

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from policyloop.weights.broadcast.sender import DistributedWeightSender

log = get_logger(__name__)


class ColocatedEngines:
    """A failed broadcast is logged and the group rebuilt at a later version; meanwhile the
    replicas load the version from the publisher (they wait for the broadcast only so long),
    so a version is never lost."""

    def __init__(self, settings: ColocatedSettings) -> None:
        self.settings = settings
        self.sender: DistributedWeightSender | None = None  # formed at the first version
        self.clients: list[SGLangClient] = []
        self.retry_at = 0.0  # monotonic time before which no new group is formed

    async def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if not self.settings.engines or (self.sender is None and time.monotonic() < self.retry_at):
            return
        from policyloop.weights.broadcast.engine_control import WeightSyncError
        from policyloop.weights.broadcast.group import WeightGroupError

        try:
            if self.sender is None:
                await self._connect()
            assert self.sender is not None
            stats = await self.sender.send(tensors, weight_version=str(version))
        except (EngineError, WeightSyncError, WeightGroupError, OSError) as exc:
            log.error("weights_broadcast_failed", version=version, error=str(exc), retry_in_s=self.settings.retry_s)
            await self.close()
            # A group that could not form leaves its rendezvous waiting in a thread until its
            # timeout: forming one at every version would pile them up.
            self.retry_at = time.monotonic() + self.settings.retry_s
            return
        WEIGHT_SYNC_SECONDS.labels("broadcast").observe(stats.seconds)
        log.info("weights_broadcast", version=version, engines=len(self.clients), buckets=stats.buckets,
                 bytes=stats.nbytes, seconds=round(stats.seconds, 3))

    async def _connect(self) -> None:
        from policyloop.weights.broadcast.sender import DistributedWeightSender, EngineTarget

        self.clients = [SGLangClient(url, timeout_s=600) for url in self.settings.engines]
        sender = DistributedWeightSender(backend=self.settings.backend, master_address=self.settings.master_address,
                                         bucket_bytes=self.settings.bucket_mb * 1024 * 1024)
        try:
            await sender.init([EngineTarget(c, self.settings.tp_size) for c in self.clients])
        except BaseException:
            await self._close_clients()
            raise
        self.sender = sender

    async def close(self) -> None:
        from policyloop.weights.broadcast.engine_control import WeightSyncError
        from policyloop.weights.broadcast.group import WeightGroupError

        sender, self.sender = self.sender, None
        if sender is not None:
            try:
                await sender.close()
            except (EngineError, WeightSyncError, WeightGroupError) as exc:
                log.warning("weights_group_close_failed", error=str(exc))
        await self._close_clients()

    async def _close_clients(self) -> None:
        for client in self.clients:
            await client.close()
        self.clients = []
