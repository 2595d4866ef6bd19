"""The embedded engine's scheduler: static batching per wave, pauses, aborts and SGLang's writer
lock for weight updates.

A scheduler task waits a few milliseconds (`batch_window_s`) after the first waiting request to
gather concurrent ones, takes up to `max_batch` of them, left-pads their prompts and runs one
prefill (once per distinct prompt: a group's samples share its cache) and then one decode step at
a time over the wave with the KV cache (2D attention mask + explicit position ids, so every row
sees exactly what it would see alone). Rows that finish (stop token / EOS, max_new_tokens, abort)
leave the cache at once; requests that arrive meanwhile wait for the next wave. The cost: a long
request keeps a wave going while newcomers wait (no continuous batching), and padding to the
longest prompt of a wave is computed. Each prefill and each decode step runs on the single compute
thread, so the HTTP server stays responsive and control actions (weight loads, pauses, aborts)
happen between two steps, never inside one.

Pause. mode abort ends every request (running or waiting) with finish_reason abort and the
tokens so far; mode in_place stops between two steps and keeps the wave until resumed; mode
retract also stops between two steps and, on resume, recomputes the wave's cache from prompt +
tokens so far (SGLang frees the KV cache of retracted requests). In every mode new requests are
held until resumed, as SGLang holds them at its tokenizer manager. `pause` returns once the
engine is actually between steps, so a weight update that follows cannot race a step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from policyloop.engines.embedded.model import ServedModel
from policyloop.engines.embedded.sampling import finish_after, sample_rows
from policyloop.engines.protocol import FinishReason, SamplingParams
from policyloop.rl.logprobs import left_padded
from policyloop.telemetry.logging import get_logger

log = get_logger("policyloop.engines.embedded")
T = TypeVar("T")


@dataclass(eq=False)
class EngineRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    return_logprob: bool
    return_text_in_logprobs: bool
    future: asyncio.Future[None]
    generator: torch.Generator | None
    received: float
    adapter: str | None = None  # the LoRA adapter it samples with (None: the base)
    logprob_start_len: int = -1  # prompt logprobs from this position (-1: none)
    input_logprobs: list[float | None] | None = None
    cached_tokens: int = 0  # prompt tokens prefilled once for an earlier row of its wave (SGLang's meta_info)
    state: str = "waiting"  # waiting → running → done
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)  # [version, start, end)
    finish: FinishReason | None = None
    abort_message: str | None = None  # set on the event loop; the scheduler ends the row
    error: BaseException | None = None
    progress: asyncio.Event | None = None  # streamed requests: set after each step that gave it a token

    def add_token(self, token: int, logprob: float, version: str) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        n = len(self.output_ids)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n
        else:
            self.spans.append([version, n - 1, n])


class Wave:
    """The requests being decoded together and their tensors (touched by the compute thread)."""

    def __init__(self, requests: list[EngineRequest], cache: Any, mask: torch.Tensor, positions: torch.Tensor,
                 next_logits: torch.Tensor, version: str) -> None:
        self.requests = requests
        self.cache = cache
        self.mask = mask            # [B, T] 1 on real tokens (left padding is 0)
        self.positions = positions  # [B, 1] position of each row's last token
        self.next_logits = next_logits  # [B, V] logits of each row's next token
        self.version = version      # weights that computed next_logits

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]
        self.next_logits = self.next_logits[index]
        self.requests = [self.requests[i] for i in rows]


class Scheduler:
    """Owns the requests in flight, the queues, the pause state and the compute thread."""

    def __init__(self, served: ServedModel, *, max_batch: int, batch_window_s: float) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.served = served
        self.max_batch = max_batch
        self.classifying = 0  # /classify requests in flight (a reward model's: engines/embedded/server.py)
        self.classified_prompts = 0
        self.activations = 0  # staged versions swapped in, and the time decoding stood still for them
        self.activation_pause_s = 0.0
        self.batch_window_s = batch_window_s
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()  # admitted to the scheduler, not yet running
        self.held: deque[EngineRequest] = deque()     # arrived while paused or while an update waits
        self.paused = False
        self.pause_mode = ""
        self.retractions = 0  # bumped by each pause in mode retract: waves recompute their cache
        self.writers = 0      # weight updates waiting for the requests in flight (SGLang's writer lock)
        self.load_lock = asyncio.Lock()  # one load into the served weights at a time (disk or broadcast)
        self.closing = False
        self.prompt_tokens = 0      # counters of /metrics
        self.generated_tokens = 0
        self.wave: Wave | None = None  # the wave being decoded (its KV cache is what the engine holds)
        self._kick = asyncio.Event()
        self._parked = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-compute")
        self._task: asyncio.Task[None] | None = None

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn` on the compute thread, after whatever it is computing."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-scheduler")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self.closing

    async def stop(self) -> None:
        self.closing = True
        self.abort_all("engine stopping")
        self._kick.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 30)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()

    def close_compute(self) -> None:
        """Ends the compute thread once nothing more will be asked of it (after the HTTP server)."""
        self._executor.shutdown(wait=True)

    # -- admission, completion, aborts (event loop) ---------------------------------------------

    def admit(self, req: EngineRequest) -> None:
        self.requests[req.rid] = req
        self.prompt_tokens += len(req.input_ids)
        if req.max_new_tokens == 0:  # nothing to decode: SGLang answers after prefill alone
            req.finish = FinishReason(type="length", length=0)
            self.complete(req)
        elif self.paused or self.writers:
            # SGLang holds a request at its tokenizer manager while paused or while a weight
            # update waits for the requests in flight; it reaches the scheduler afterwards.
            self.held.append(req)
        else:
            self.waiting.append(req)
            self._kick.set()

    def complete(self, req: EngineRequest) -> None:
        req.state = "done"
        if not req.future.done():
            req.future.set_result(None)

    def abort(self, req: EngineRequest, message: str) -> None:
        if req.state == "done":
            return
        if req.state == "waiting":
            for queue in (self.waiting, self.held):
                with contextlib.suppress(ValueError):
                    queue.remove(req)
            req.finish = FinishReason(type="abort", message=message)
            self.complete(req)
        else:
            req.abort_message = message
            self._kick.set()

    def abort_all(self, message: str) -> int:
        targets = list(self.requests.values())
        for req in targets:
            self.abort(req, message)
        return len(targets)

    def pending(self) -> list[EngineRequest]:
        """Requests the scheduler holds: queued or running (paused in place or retracted too)."""
        return [r for r in self.requests.values() if r.state == "running" or r in self.waiting]

    def flush_refusal(self, field_name: str) -> str:
        pending = self.pending()
        running = sum(r.state == "running" for r in pending)
        return (f"{field_name}: Cache not flushed because there are pending requests. #queue-req: "
                f"{len(pending) - running}, #running-req: {running} (paused {self.pause_mode or 'no'}); SGLang "
                f"fails 'Cache flush failed after updating weights' here: update with flush_cache=false, or "
                f"pause in mode abort")

    # -- pause and the writer lock --------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort_all("generation paused (mode abort)")
        elif mode == "retract":
            self.retractions += 1
        self.paused, self.pause_mode = True, mode
        await self._until_parked()

    def resume(self) -> None:
        self.paused, self.pause_mode = False, ""
        self._release_held()
        self._kick.set()

    def _release_held(self) -> None:
        if self.paused or self.writers:
            return
        while self.held:
            self.waiting.append(self.held.popleft())
        self._kick.set()

    @contextlib.asynccontextmanager
    async def weight_update(self, abort_all_requests: bool) -> AsyncIterator[None]:
        """SGLang's rule for a weight update: when generation is paused it applies at once (the
        requests in flight keep their state); otherwise it takes the model's writer lock — new
        requests wait, and the update waits until those in flight have finished."""
        if abort_all_requests:
            self.abort_all("aborted for a weight update")
        if self.paused:
            yield
            return
        self.writers += 1
        try:
            while self.pending():
                await asyncio.sleep(0.005)
            yield
        finally:
            self.writers -= 1
            self._release_held()

    async def _park(self) -> None:
        self._parked.set()
        try:
            await self._kick.wait()
        finally:
            self._kick.clear()
            self._parked.clear()

    async def _until_parked(self) -> None:
        """Returns once the scheduler is waiting between steps (after what it was computing)."""
        self._parked.clear()
        self._kick.set()
        while not self._parked.is_set():
            if self._task is None or self._task.done():
                return
            try:
                await asyncio.wait_for(self._parked.wait(), 1.0)
            except TimeoutError:
                continue

    # -- the loop (event loop) ------------------------------------------------------------------

    async def _run(self) -> None:
        while not self.closing:
            if self.paused or not self.waiting:
                await self._park()
                continue
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)
            if self.paused or not self.waiting or self.closing:
                continue
            batch = [self.waiting.popleft() for _ in range(min(self.max_batch, len(self.waiting)))]
            for req in batch:
                req.state = "running"
            try:
                await self._decode_wave(batch)
            except Exception as exc:  # a failed step fails its wave, not the engine
                log.exception("engine_step_failed", error=repr(exc))
                for req in batch:
                    if req.state != "done":
                        req.error = exc
                        self.complete(req)

    @property
    def kv_tokens(self) -> int:
        """Token positions held in the KV cache now (the wave's rows × its width, padding included)."""
        wave = self.wave
        return 0 if wave is None or not wave.requests else int(wave.mask.numel())

    @property
    def kv_capacity(self) -> int | None:
        """The most positions a wave can hold: max_batch rows of the model's context (None: unknown)."""
        return None if self.served.max_context is None else self.max_batch * int(self.served.max_context)

    async def _decode_wave(self, batch: list[EngineRequest]) -> None:
        try:
            await self._decode(batch)
        finally:
            self.wave = None

    async def _decode(self, batch: list[EngineRequest]) -> None:
        retractions = self.retractions  # this wave's cache was computed after these
        wave = self.wave = await self.compute(self._prefill, batch)
        while wave.requests:
            if any(r.abort_message is not None for r in wave.requests):
                finished = await self.compute(self._step, wave, False)
            elif self.paused:
                await self._park()
                continue
            elif self.retractions != retractions:
                # Retracted while paused: the cache was given up; recompute prompt + tokens so far
                # with the weights that serve now.
                retractions = self.retractions
                wave = self.wave = await self.compute(self._prefill, wave.requests)
                continue
            else:
                stepped = wave.requests  # the step replaces the list as rows finish
                finished = await self.compute(self._step, wave, True)
                for req in stepped:
                    if req.progress is not None:
                        req.progress.set()
            for req in finished:
                self.complete(req)

    # -- compute (the compute thread) -----------------------------------------------------------

    def _prefill(self, batch: list[EngineRequest]) -> Wave:
        with torch.inference_mode():
            # Prompt plus the tokens so far (none, unless the wave was retracted).
            rows = [(tuple(r.input_ids + r.output_ids), r.adapter) for r in batch]
            # Rows with the same tokens and adapter (a group's samples) are computed once and their
            # cache shared, as SGLang's radix cache shares a common prefix.
            distinct = list(dict.fromkeys(rows))
            ids, mask, positions = left_padded([tokens for tokens, _ in distinct], self.served.pad_id)
            logits, cache = self.served.forward(ids, mask, positions, None, [adapter for _, adapter in distinct])
            if len(distinct) < len(rows):
                where = {row: i for i, row in enumerate(distinct)}
                index = torch.tensor([where[row] for row in rows], dtype=torch.long)
                first: set[int] = set()
                for req, i in zip(batch, index.tolist(), strict=True):
                    if i in first:
                        req.cached_tokens = max(req.cached_tokens, len(req.input_ids))
                    first.add(i)
                cache.batch_select_indices(index)
                logits, mask, positions = logits[index], mask[index], positions[index]
            for req in batch:
                if req.logprob_start_len >= 0 and req.input_logprobs is None:
                    prompt = self.served.prompt_logprobs(req.input_ids, req.adapter)
                    req.input_logprobs = [None] + [lp if i + 1 >= req.logprob_start_len else None
                                                   for i, lp in enumerate(prompt)]
            return Wave(list(batch), cache, mask, positions[:, -1:], logits, self.served.weight_version)

    def _step(self, wave: Wave, sample: bool) -> list[EngineRequest]:
        """Samples one token for every row (when `sample`), retires finished and aborted rows, and
        computes the next logits of the rest. Returns the requests that finished."""
        with torch.inference_mode():
            drawn = sample_rows(wave.next_logits, [r.params for r in wave.requests],
                                [r.generator for r in wave.requests]) if sample else []
            finished: list[EngineRequest] = []
            keep: list[int] = []
            for i, req in enumerate(wave.requests):
                if req.abort_message is not None:
                    req.finish = FinishReason(type="abort", message=req.abort_message)
                    finished.append(req)
                    continue
                if sample:
                    token, logprob = drawn[i]
                    req.add_token(token, logprob, wave.version)
                    self.generated_tokens += 1
                    req.finish = finish_after(
                        token, len(req.output_ids), req.max_new_tokens, req.params, self.served.eos_ids,
                        lambda req=req: self.served.decode(req.output_ids,
                                                           skip_special_tokens=req.params.skip_special_tokens))
                    if req.finish is not None:
                        finished.append(req)
                        continue
                keep.append(i)
            if len(keep) < len(wave.requests):
                if keep:
                    wave.keep(keep)
                else:
                    wave.requests = []
            if sample and wave.requests:
                self._advance(wave)
            return finished

    def _advance(self, wave: Wave) -> None:
        """Feeds each row's last token: the wave's next logits, under the weights serving now."""
        tokens = torch.tensor([[r.output_ids[-1]] for r in wave.requests], dtype=torch.long)
        wave.mask = torch.cat([wave.mask, torch.ones((len(wave.requests), 1), dtype=torch.long)], dim=1)
        wave.positions = wave.positions + 1
        wave.next_logits, wave.cache = self.served.forward(tokens, wave.mask, wave.positions, wave.cache,
                                                           [r.adapter for r in wave.requests])
        wave.version = self.served.weight_version
