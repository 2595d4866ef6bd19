"""Sandbox sessions: one isolated process that keeps its state across the steps of one episode.

A session is a SandboxJob with `session` set, taken from the SESSIONS stream (its own, so that
long sessions never hold the slots of short jobs), and run
under the same namespaces, limits and accounting (sandbox/runner.py). While it lives, the
sandbox answers SessionStep requests (core NATS request/reply) on the job's `channel_subject`:
each step's line goes to the process's stdin and its next stdout line comes back. A step not
answered within `step_seconds` ends the session (SANDBOX_LIMIT_STEP_TIME); the job's wall clock
bounds the whole episode. The caller closes the session at the episode's end: its stdin closes,
the process has a moment to exit, then it is killed; the close's reply (and the job's
reply_subject) carries the SandboxResult with its CPU time and memory. A session whose first step
does not come within FIRST_STEP_S is abandoned (SANDBOX_LIMIT_ABANDONED): its caller gave up, or
it is a redelivery after the sandbox that ran it died, and nobody will ever talk to it.

`SessionChannel` is the sandbox's side, `Session` the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from policyloop.bus import Bus, session_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.client import PUBLISH_MARGIN_S

L = bus_pb2.SandboxLimit
OPEN_POLL_S = 0.02            # how often a caller asks whether its queued session has started
STEP_MARGIN_S = 10.0          # a step's wait beyond its limit: the sandbox's own kill and result
FIRST_STEP_S = 30.0           # a live caller asks every OPEN_POLL_S until its session starts


class SessionChannel:
    """The sandbox's side: steps in from NATS, through the process's stdin and stdout, back out."""

    def __init__(self, step_seconds: float, first_step_s: float = FIRST_STEP_S) -> None:
        self.step_seconds, self.first_step_s = step_seconds, first_step_s
        self._steps: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: Any = None        # the request answered when the session ends
        self._result: bus_pb2.SandboxResult | None = None

    async def on_step(self, msg: Any) -> None:
        """A request on the channel subject (nats-py's subscription callback)."""
        if self._result is not None:
            await msg.respond(self._ended_reply())
            return
        await self._steps.put(msg)

    async def run(self, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader) -> bus_pb2.SandboxLimit:
        try:  # no caller asking: nobody would ever talk to this process
            msg = await asyncio.wait_for(self._steps.get(), self.first_step_s)
        except TimeoutError:
            stdin.close()
            return L.SANDBOX_LIMIT_ABANDONED
        while True:
            self._pending = msg
            try:
                step = bus_pb2.SessionStep.FromString(msg.data)
            except Exception:  # noqa: BLE001 - a caller's bad bytes end only its session
                step = bus_pb2.SessionStep(close=True)
            if step.close:
                stdin.close()
                return L.SANDBOX_LIMIT_NONE
            try:
                stdin.write(step.line + b"\n")
                await stdin.drain()
                line = await asyncio.wait_for(stdout.readline(), self.step_seconds)
            except TimeoutError:
                return L.SANDBOX_LIMIT_STEP_TIME
            except ValueError:  # a line past the reader's limit
                return L.SANDBOX_LIMIT_OUTPUT
            except (BrokenPipeError, ConnectionResetError):
                return L.SANDBOX_LIMIT_NONE  # it exited: its result says how
            if not line.endswith(b"\n"):  # end of its stdout: it exited
                return L.SANDBOX_LIMIT_NONE
            self._pending = None
            await msg.respond(bus_pb2.SessionStepReply(line=line[:-1]).SerializeToString())
            msg = await self._steps.get()

    async def finish(self, result: bus_pb2.SandboxResult) -> None:
        """The session is over: the step in flight, and any that come later, get its result."""
        self._result = result
        pending, self._pending = self._pending, None
        while not self._steps.empty():
            await self._steps.get_nowait().respond(self._ended_reply())
        if pending is not None:
            await pending.respond(self._ended_reply())

    def _ended_reply(self) -> bytes:
        return bus_pb2.SessionStepReply(ended=True, result=self._result).SerializeToString()


class SessionEnded(RuntimeError):
    """The session is over (its process exited, or a limit ended it) before the step was answered."""

    def __init__(self, result: bus_pb2.SandboxResult) -> None:
        self.result = result
        limit = bus_pb2.SandboxLimit.Name(result.limit_hit)
        how = result.error or (f"limit {limit}" if result.limit_hit else f"exit code {result.exit_code}")
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] if result.stderr else []
        super().__init__(f"the session ended ({how})" + (f": {tail[0]}" if tail else ""))


class SessionUnavailable(TimeoutError):
    """No sandbox started the session, or answered a step, within the deadline."""


class Session:
    """The caller's side of one session: `step` sends a line and returns the answer; `close` ends
    it and returns its result. Use as an async context manager (closed on exit, whatever happened)."""

    def __init__(self, bus: Bus, job: bus_pb2.SandboxJob, *, kind: str, step_seconds: float,
                 open_timeout_s: float) -> None:
        self.bus, self.kind, self.step_seconds, self.open_timeout_s = bus, kind, step_seconds, open_timeout_s
        self.job = bus_pb2.SandboxJob()
        self.job.CopyFrom(job)
        self.job.job_id = f"{job.job_id or 'session'}#{uuid.uuid4().hex[:12]}"
        self.job.reply_subject = bus.nc.new_inbox()
        self.job.session.channel_subject = bus.nc.new_inbox()
        self.job.session.step_seconds = step_seconds
        self.result: bus_pb2.SandboxResult | None = None
        self._started = False
        self._sub: Any = None

    async def __aenter__(self) -> Session:
        self.job.expires_unix_ms = int((time.time() + self.open_timeout_s + PUBLISH_MARGIN_S) * 1000)

        async def on_result(msg: Any) -> None:
            if self.result is None:
                self.result = bus_pb2.SandboxResult.FromString(msg.data)

        self._sub = await self.bus.nc.subscribe(self.job.reply_subject, cb=on_result)
        await self.bus.publish(session_subject(self.kind), self.job, self.job.job_id)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.close()
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def step(self, line: bytes) -> bytes:
        reply = await self._request(bus_pb2.SessionStep(line=line))
        if reply.ended:
            self.result = reply.result
            raise SessionEnded(reply.result)
        return reply.line

    async def close(self) -> bus_pb2.SandboxResult | None:
        """Ends the session; its result (None when it never started)."""
        if self.result is None and self._started:
            reply = await self._request(bus_pb2.SessionStep(close=True))
            self.result = reply.result
        return self.result

    async def _request(self, step: bus_pb2.SessionStep) -> bus_pb2.SessionStepReply:
        """Until the session starts (it may wait in SANDBOX for a free sandbox) nobody answers on
        its channel: asked again until `open_timeout_s`. Once started, a step waits its time limit
        and a margin (the sandbox answers a step that ran out with the session's result)."""
        data = step.SerializeToString()
        deadline = time.monotonic() + self.open_timeout_s
        subject = self.job.session.channel_subject
        while True:
            if self.result is not None:
                return bus_pb2.SessionStepReply(ended=True, result=self.result)
            timeout = self.step_seconds + STEP_MARGIN_S
            try:
                msg = await self.bus.nc.request(subject, data, timeout=timeout)
            except NoRespondersError:
                if self._started or time.monotonic() > deadline:
                    raise SessionUnavailable(f"session {self.job.job_id}: not started within "
                                             f"{self.open_timeout_s}s") from None
                await asyncio.sleep(OPEN_POLL_S)
                continue
            except NatsTimeout:
                raise SessionUnavailable(f"session {self.job.job_id}: no answer within {timeout}s") from None
            self._started = True
            return bus_pb2.SessionStepReply.FromString(msg.data)

