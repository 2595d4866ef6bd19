"""The replica's engine: the embedded one started as a child process, and the version label an
engine serves."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from policyloop.common.ports import free_port
from policyloop.engines.embedded_client import EmbeddedEngineClient
from policyloop.engines.protocol import ModelInfo
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rollout.settings import RolloutSettings
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


def _die_with_parent() -> None:
    """Runs in the engine child before exec: the kernel sends it SIGTERM when the rollout
    process dies, even by SIGKILL, so no engine outlives its replica."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_embedded_engine(model_path: Path, port: int, *, max_batch: int, threads: int) -> subprocess.Popen:
    """The embedded engine on 127.0.0.1:`port`, a child process that dies with its parent."""
    return subprocess.Popen(
        [sys.executable, "-m", "policyloop.engines.embedded", "--model-path", str(model_path),
         "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(max_batch),
         "--threads", str(threads)],
        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


def engine_client(settings: RolloutSettings, url: str) -> SGLangClient:
    """The client of the replica's engine: the embedded engine's also stages and swaps versions."""
    kind = EmbeddedEngineClient if settings.engine == "embedded" else SGLangClient
    return kind(url, timeout_s=settings.generate_timeout_s)


def engine_url_or_start(engine_url: str, model_path: Path, *, max_batch: int, threads: int
                        ) -> tuple[str, subprocess.Popen | None]:
    """The engine's URL: `engine_url`, or (empty) that of an embedded engine started now as a
    child process, returned with it (stop it with stop_engine)."""
    if engine_url:
        return engine_url, None
    port = free_port()
    proc = start_embedded_engine(model_path, port, max_batch=max_batch, threads=threads)
    return f"http://127.0.0.1:{port}", proc


async def stop_engine(proc: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """Stops an embedded engine started by engine_url_or_start: SIGTERM, then SIGKILL after `grace_s`."""
    if proc is None:
        return
    proc.terminate()
    try:
        await asyncio.to_thread(proc.wait, grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()


async def wait_for_engine(client: SGLangClient, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the embedded engine exited with {proc.returncode}")
        if await client.health(timeout_s=2):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine at {client.base_url} did not become healthy within {timeout_s}s")
        await asyncio.sleep(0.25)


def engine_version(info: ModelInfo) -> int:
    """The engine's weight version as a policy version (0 for SGLang's "default" and the like)."""
    try:
        return int(info.weight_version or 0)
    except ValueError:
        return 0


async def name_base_version(client: SGLangClient) -> int:
    """The policy version the engine serves. An engine that has not been told one (SGLang boots
    at "default") serves the base weights it was started with: it is relabelled "0", so that
    every sample it makes carries a policy version."""
    info = await client.model_info()
    if info.weight_version and info.weight_version.isdigit():
        return int(info.weight_version)
    log.info("engine_version_named", was=info.weight_version, now="0")
    await client.update_weight_version("0", abort_all_requests=False)
    return 0

