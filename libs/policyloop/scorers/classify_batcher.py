"""Samples of concurrent scorings gathered into /classify calls to a reward model's engines.

Each sample waits in one queue per reward model. A call takes up to `max_batch` of them, once that
many wait or the oldest has waited `max_wait_s`; at most `concurrency` calls are in flight, and
samples arriving meanwhile go in the next, fuller batches (the engine's batching, done where the
samples of many groups meet). A call that fails goes to the next engine; one an engine refuses
(4xx) is split, so that only the sample it cannot score fails, and with the engine's reason."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from policyloop.engines.sglang_client import EngineError, EngineUnavailable, SGLangClient
from policyloop.scorers.score import UnscorableTrajectory
from policyloop.telemetry.metrics import (
    REWARD_MODEL_BATCH,
    REWARD_MODEL_CALL_SECONDS,
    REWARD_MODEL_FAILURES,
    REWARD_MODEL_QUEUE,
)


class RewardModelUnavailable(RuntimeError):
    """No engine of the reward model gave a score in time: the scoring is retried later."""


@dataclass
class _Waiting:
    text: str
    future: asyncio.Future[float]
    since: float = field(default_factory=time.monotonic)


class ClassifyBatcher:
    def __init__(self, model: str, clients: Sequence[SGLangClient], *, max_batch: int, max_wait_s: float,
                 concurrency: int) -> None:
        if not clients:
            raise ValueError(f"reward model {model!r}: no engines")
        self.model = model
        self.clients = list(clients)
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._calls = asyncio.Semaphore(concurrency)
        self._waiting: deque[_Waiting] = deque()
        self._arrived = asyncio.Event()
        self._turn = 0
        self._runner: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()

    async def score(self, text: str, timeout_s: float) -> float:
        """The reward model's score of `text`; RewardModelUnavailable when none came within
        `timeout_s`, UnscorableTrajectory when the model refuses this text."""
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name=f"classify-batcher-{self.model}")
        waiting = _Waiting(text, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        self._arrived.set()
        REWARD_MODEL_QUEUE.labels(self.model).set(len(self._waiting))
        try:
            return await asyncio.wait_for(asyncio.shield(waiting.future), timeout_s)
        except TimeoutError:
            REWARD_MODEL_FAILURES.labels(self.model, "timeout").inc()
            raise RewardModelUnavailable(f"reward model {self.model!r}: no score within {timeout_s:g} s "
                                         f"({len(self._waiting)} samples queued)") from None

    async def close(self) -> None:
        tasks = [t for t in (self._runner, *self._in_flight) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for waiting in self._waiting:
            if not waiting.future.done():
                waiting.future.set_exception(RewardModelUnavailable(f"reward model {self.model!r}: closed"))
        for client in self.clients:
            await client.close()

    async def _run(self) -> None:
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = self._waiting[0].since + self.max_wait_s
            while len(self._waiting) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    break
            await self._calls.acquire()  # while every call is out, the queue grows into the next batch
            batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
            REWARD_MODEL_QUEUE.labels(self.model).set(len(self._waiting))
            batch = [w for w in batch if not w.future.done()]  # given up on (timed out) while they waited
            if not batch:
                self._calls.release()
                continue
            task = asyncio.create_task(self._call(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _call(self, batch: list[_Waiting]) -> None:
        try:
            await self._score(batch)
        finally:
            self._calls.release()

    async def _score(self, batch: list[_Waiting]) -> None:
        started = time.monotonic()
        try:
            scores = await self._classify([w.text for w in batch])
        except EngineError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and len(batch) > 1:
                for one in batch:  # only the sample the model cannot take fails
                    await self._score([one])
                return
            refused = exc.status is not None and 400 <= exc.status < 500
            REWARD_MODEL_FAILURES.labels(self.model, "refused" if refused else "unavailable").inc()
            error: Exception = (UnscorableTrajectory(f"reward model {self.model!r} refused the sample: {exc}")
                                if refused else RewardModelUnavailable(f"reward model {self.model!r}: {exc}"))
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.set_exception(error)
            return
        REWARD_MODEL_BATCH.labels(self.model).observe(len(batch))
        REWARD_MODEL_CALL_SECONDS.labels(self.model).observe(time.monotonic() - started)
        for waiting, score in zip(batch, scores, strict=True):
            if not waiting.future.done():
                waiting.future.set_result(score)

    async def _classify(self, texts: list[str]) -> list[float]:
        """One /classify call, on the engines in turn: an engine that cannot be reached passes it on."""
        last: EngineError | None = None
        for _ in range(len(self.clients)):
            client = self.clients[self._turn % len(self.clients)]
            self._turn += 1
            try:
                return [result.score for result in await client.classify(texts)]
            except EngineUnavailable as exc:
                last = exc
            except ValueError as exc:  # an answer that is not one score per text
                raise EngineError(f"{client.base_url}: {exc}", None, "") from exc
        assert last is not None
        raise last
