"""runtime.run_loops, which a role runs its loops under (the learner's kinds of run): a loop that
fails stops the process and is raised by name; at the stop, loops finish, then `after_stop`."""

from __future__ import annotations

import asyncio

import pytest

from policyloop.runtime import ServiceContext, ServiceSettings, run_loops


def context() -> ServiceContext:
    return ServiceContext(name="learner", settings=ServiceSettings(), bus=None, redis=None)  # type: ignore[arg-type]


async def test_a_failed_loop_stops_the_process_and_is_raised() -> None:
    ctx, finished = context(), []

    async def steady() -> None:
        await ctx.stop.wait()
        finished.append("steady")

    async def broken() -> None:
        raise OSError("the device is gone")

    async def after() -> None:
        finished.append("after_stop")

    with pytest.raises(RuntimeError, match="the broken loop failed") as raised:
        await asyncio.wait_for(run_loops(ctx, {"steady": steady(), "broken": broken()}, after_stop=after), 10)
    assert isinstance(raised.value.__cause__, OSError) and ctx.stop.is_set()
    assert finished == ["steady", "after_stop"]  # the others finished their work before the end


async def test_at_the_stop_loops_finish_and_one_that_does_not_is_cancelled() -> None:
    ctx, cancelled = context(), []

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("stuck")
            raise

    running = asyncio.create_task(run_loops(ctx, {"stuck": stuck()}, finish_s=0.1))
    await asyncio.sleep(0)
    assert ctx.ready  # no pull workers: ready at once
    ctx.stop.set()
    await asyncio.wait_for(running, 10)  # a cancelled loop is no failure
    assert cancelled == ["stuck"]
