"""Bus throughput on this machine: acknowledged publishes per second (one at a time, as the
services publish) and messages per second through a PullWorker (decode, handler, ack), against
a nats-server of its own. Prints JSON with the median over repeats.

    .venv/bin/python perf/bus_throughput.py --messages 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from policyloop.bus import Bus, Delivery, PullWorker, build_topology, tasks_subject
from policyloop.bus.topology import BusLimits
from policyloop.cluster.local import start_nats
from policyloop.contracts.v1 import bus_pb2
from policyloop.telemetry.logging import configure_logging


def task(i: int, prompt_tokens: int) -> bus_pb2.Task:
    return bus_pb2.Task(task_id=f"t{i}", run_id="perf", environment="perf@1",
                        prompt_token_ids=list(range(prompt_tokens)), group_size=8)


async def one_round(url: str, messages: int, concurrency: int, prompt_tokens: int, round_no: int) -> dict:
    bus = await Bus.connect(url, name="perf", topology=build_topology(BusLimits(tasks_capacity=messages + 10)))
    await bus.ensure_topology()
    await bus.js.purge_stream("TASKS")
    payload_bytes = len(task(0, prompt_tokens).SerializeToString())
    t0 = time.perf_counter()
    for i in range(messages):
        await bus.publish(tasks_subject("perf@1"), task(i, prompt_tokens), f"r{round_no}-{i}")
    publish_s = time.perf_counter() - t0
    done = asyncio.Event()
    handled = 0

    async def handle(_: Delivery[bus_pb2.Task]) -> None:
        nonlocal handled
        handled += 1
        if handled == messages:
            done.set()

    worker = PullWorker(bus, bus.topology.consumers["rollout"], bus_pb2.Task, handle, service="perf",
                        concurrency=concurrency, fetch_timeout_s=0.5)
    stop = asyncio.Event()
    t1 = time.perf_counter()
    loop = asyncio.create_task(worker.run(stop))
    await done.wait()
    consume_s = time.perf_counter() - t1
    stop.set()
    await loop
    await worker.drain(5)
    await bus.close()
    return {"publish_per_s": messages / publish_s, "consume_per_s": messages / consume_s,
            "payload_bytes": payload_bytes}


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        nats = start_nats(Path(tmp))
        url = f"nats://127.0.0.1:{nats.ports['client']}"
        try:
            rounds = [await one_round(url, args.messages, args.concurrency, args.prompt_tokens, r)
                      for r in range(args.repeats)]
        finally:
            assert nats.proc is not None
            nats.proc.terminate()
            nats.proc.wait()
    return {
        "benchmark": "bus_throughput",
        "messages": args.messages,
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "payload_bytes": rounds[0]["payload_bytes"],
        "publish_acked_per_s_median": round(statistics.median(r["publish_per_s"] for r in rounds), 1),
        "consume_acked_per_s_median": round(statistics.median(r["consume_per_s"] for r in rounds), 1),
        "publish_acked_per_s": [round(r["publish_per_s"], 1) for r in rounds],
        "consume_acked_per_s": [round(r["consume_per_s"], 1) for r in rounds],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    configure_logging(service="perf", run_id="", instance="bus_throughput", level="WARNING")  # stdout: JSON only
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
