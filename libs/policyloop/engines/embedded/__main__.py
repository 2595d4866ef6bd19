"""`python -m policyloop.engines.embedded`: one engine serving until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from policyloop.engines.embedded.server import start_engine
from policyloop.engines.protocol import DEFAULT_WEIGHT_VERSION
from policyloop.models.resolve import ModelNotFound, resolve_model
from policyloop.telemetry.logging import configure_logging


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m policyloop.engines.embedded",
                                     description="The embedded engine: SGLang's native HTTP API on a CPU.")
    parser.add_argument("--model-path", required=True,
                        help="a Hugging Face causal-LM directory, or a Hugging Face model id (org/name[@revision]) "
                             "found through the Hugging Face cache (HF_HOME; fetched into it unless HF_HUB_OFFLINE=1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch", type=int, default=64, help="most requests decoded together")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--weight-version", default=DEFAULT_WEIGHT_VERSION,
                        help="the version reported until the first update (SGLang's default: \"default\")")
    parser.add_argument("--batch-window-ms", type=float, default=5.0,
                        help="how long to gather concurrent requests into one wave")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                        help="where the model computes (auto: CUDA when torch sees a GPU)")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    engine = await start_engine(args.model_path, host=args.host, port=args.port, max_batch=args.max_batch,
                                threads=args.threads, weight_version=args.weight_version,
                                batch_window_s=args.batch_window_ms / 1000, device=args.device)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await engine.stop()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    try:  # a model id: its snapshot in the Hugging Face cache, fetched first unless HF_HUB_OFFLINE=1
        args.model_path = str(resolve_model(args.model_path, setting="--model-path"))
    except ModelNotFound as exc:
        sys.exit(f"python -m policyloop.engines.embedded: {exc}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory from here on: never reach for the hub
    configure_logging(service="engine", run_id="", instance=f"{args.host}:{args.port}")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
