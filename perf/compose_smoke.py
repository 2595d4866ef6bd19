"""The compose cluster, driven from the host like a user: it must come up, learn, survive losing
its learner and a rollout replica, scale, and leave nothing behind.

1. `docker/compose.sh up -d --no-build` (the images `make images` built), then waits until every
   service's container is healthy and the `models` job has finished.
2. Held-out accuracy before (`policyloop evaluate` in the rollout container, against its engine).
3. Submits the arithmetic environment and starts a run through the gateway's published gRPC port.
4. Trains for --train-s, then SIGKILLs the learner container's and one rollout container's init
   from the host (a crash: the restart policy brings them back) and scales rollout to 2.
5. Waits until the learner has taken --steps-after-kills steps past the version it was killed at,
   measures held-out accuracy again, stops the run, lets the loop settle and audits the ledger
   (`policyloop audit`: lost, trained twice, versions monotonic), and runs hostile jobs through the
   sandbox in its container (`policyloop sandbox-check`).
6. `down --volumes`, and checks that no container or volume of the project is left.

Prints JSON (and writes it to --out/result.json) and exits 0 when `ok`, 1 when not; `ok` needs
all of: healthy, accuracy gain of at least --min-gain, recovery after the kills, two healthy
rollout replicas, a clean audit, every hostile job contained, nothing left behind.

    make images && .venv/bin/python perf/compose_smoke.py

Before anything it checks what it needs (a container engine, a compose, the images `make images`
built, policyloop's Python packages) and, if something is missing, says what to run and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Missing packages are reported with the rest of what is missing (preflight), not as a traceback.
try:
    import grpc

    from policyloop.cluster.catalogue import SERVICE_NAMES
    from policyloop.common.ports import free_port
    from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
    from policyloop.demo.loop import start_arithmetic_run
    IMPORT_ERROR: ImportError | None = None
except ImportError as exc:
    IMPORT_ERROR = exc

REPO = Path(__file__).resolve().parents[1]
COMPOSE = str(REPO / "docker" / "compose.sh")
IMAGES_ENV = REPO / "docker" / "images.env"


def _succeeds(*command: str) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def preflight() -> list[str]:
    """What this run needs and this host lacks, each with what to run; empty when all is here."""
    missing = []
    if IMPORT_ERROR is not None:
        missing.append(f"{IMPORT_ERROR.name or 'a package'} cannot be imported by {sys.executable}: run "
                       "`make venv`, then `.venv/bin/python perf/compose_smoke.py` (or `make compose-smoke`)")
    docker = shutil.which("docker") is not None and _succeeds("docker", "info")
    engine = "docker" if docker else "podman" if shutil.which("podman") else None
    if engine is None:
        return [*missing, "no container engine (no running Docker engine, no podman): run `sudo make podman-setup` "
                          "(rootful podman) or install Docker, then `make images`"]
    if engine == "podman" and os.geteuid() != 0:
        missing.append("compose runs on rootful podman here: run this as root (sudo)")
    composes = [shutil.which(name) for name in ("docker-compose", "podman-compose")]
    if not (docker and _succeeds("docker", "compose", "version")) and not any(composes):
        missing.append("no compose (docker compose, docker-compose or podman-compose): run `sudo make podman-setup`")
    if not IMAGES_ENV.exists():
        return [*missing, f"no images built ({IMAGES_ENV.relative_to(REPO)} is missing): run `make images`"]
    images = [line.split("=", 1)[1].strip() for line in IMAGES_ENV.read_text().splitlines()
              if "=" in line and not line.startswith("#")]
    absent = [image for image in images if not _succeeds(engine, "image", "inspect", image)]
    if absent:
        missing.append(f"{engine} has no image {', '.join(absent)}: run `make images`")
    return missing


class Compose:
    """docker/compose.sh for one project, and the container engine underneath it."""

    def __init__(self, project: str, gateway_port: int) -> None:
        self.project = project
        # The Tinker API's published port too (8088 by default) on a free one: nothing else on the host collides.
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "POLICYLOOP_GATEWAY_PORT": str(gateway_port),
                    "POLICYLOOP_TINKER_PORT": str(free_port())}
        self.engine = "docker" if shutil.which("docker") and subprocess.run(
            ["docker", "info"], capture_output=True).returncode == 0 else "podman"

    def __call__(self, *args: str, timeout_s: float = 900, check: bool = True) -> str:
        result = subprocess.run([COMPOSE, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result.stdout

    def exec_json(self, service: str, *command: str, index: int = 1, timeout_s: float = 600, check: bool = True
                  ) -> dict:
        out = self("exec", "-T", "--index", str(index), service, *command, timeout_s=timeout_s, check=check)
        # Log lines may come before the JSON document, which starts on a line of its own.
        return json.loads(out[re.search(r"^\{$", out, flags=re.MULTILINE).start():])  # type: ignore[union-attr]

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        label = [f"label=com.docker.compose.project={self.project}"]
        if service:
            label.append(f"label=com.docker.compose.service={service}")
        command = [self.engine, "ps", "-q", *(["-a"] if all_states else [])]
        for item in label:
            command += ["--filter", item]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()

    def inspect(self, container: str, template: str) -> str:
        return subprocess.run([self.engine, "inspect", "-f", template, container], capture_output=True, text=True,
                              check=True).stdout.strip()

    def volumes(self) -> list[str]:
        return subprocess.run([self.engine, "volume", "ls", "-q", "--filter",
                               f"label=com.docker.compose.project={self.project}"],
                              capture_output=True, text=True, check=True).stdout.split()

    def health(self) -> dict[str, list[str]]:
        """service -> the health of each of its running containers."""
        states: dict[str, list[str]] = {}
        for container in self.containers():
            service = self.inspect(container, '{{index .Config.Labels "com.docker.compose.service"}}')
            states.setdefault(service, []).append(self.inspect(container, "{{.State.Health.Status}}"))
        return states

    def kill_init(self, container: str) -> int:
        """SIGKILL to the container's init from the host: a crash, which the restart policy
        answers (an engine's own `kill` counts as a deliberate stop)."""
        pid = int(self.inspect(container, "{{.State.Pid}}"))
        os.kill(pid, 9)
        return pid


def until(check, timeout_s: float, poll_s: float = 3.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except (RuntimeError, ValueError, subprocess.CalledProcessError):
            pass  # a container being restarted
        time.sleep(poll_s)
    return False


def all_healthy(compose: Compose, replicas: dict[str, int]) -> bool:
    health = compose.health()
    return all(health.get(name, []).count("healthy") >= replicas.get(name, 1)
               for name in ("nats", "redis", *SERVICE_NAMES))


def newest_version(compose: Compose) -> int:
    return int(compose.exec_json("gateway", "policyloop", "audit")["newest_version"])


async def start_run(gateway: str, seed: int) -> str:
    async with grpc.aio.insecure_channel(gateway) as channel:
        _, run = await start_arithmetic_run(loop_pb2_grpc.LoopServiceStub(channel), 8, 8, 1.0, seed)
        return run.run_id


async def stop_run(gateway: str, run_id: str) -> None:
    async with grpc.aio.insecure_channel(gateway) as channel:
        await loop_pb2_grpc.LoopServiceStub(channel).StopRun(loop_pb2.StopRunRequest(run_id=run_id), timeout=30)


def drive(compose: Compose, args: argparse.Namespace, result: dict) -> None:
    started = time.monotonic()

    def mark(name: str) -> None:
        result["timeline_s"][name] = round(time.monotonic() - started, 1)
        print(f"[{result['timeline_s'][name]:7.1f}s] {name}", file=sys.stderr)

    # `up` itself waits for the conditions compose.yaml names (healthy NATS and Redis, the models
    # job's bootstrap build): the start deadline covers it and the wait for every service after it.
    compose("up", "-d", "--no-build", timeout_s=args.start_timeout_s)
    result["healthy"] = until(lambda: all_healthy(compose, {}), args.start_timeout_s - (time.monotonic() - started))
    mark("healthy")
    if not result["healthy"]:
        raise RuntimeError(f"not healthy: {compose.health()}")
    before = compose.exec_json("rollout", "policyloop", "evaluate", "--problems", str(args.eval_problems))
    result["accuracy_before"] = before["accuracy"]
    mark("evaluated_before")
    gateway = f"127.0.0.1:{result['gateway_port']}"
    run_id = asyncio.run(start_run(gateway, args.seed))
    mark("run_started")
    time.sleep(args.train_s)  # the run trains meanwhile: this is the length of the first phase

    killed_at = newest_version(compose)
    learner = compose.containers("learner")[0]
    rollout = compose.containers("rollout")[0]
    result["kills"] = [{"service": "learner", "at_version": killed_at, "pid": compose.kill_init(learner)},
                       {"service": "rollout", "at_version": killed_at, "pid": compose.kill_init(rollout)}]
    mark("killed_learner_and_rollout")
    compose("up", "-d", "--no-build", "--no-recreate", "--scale", "rollout=2")
    mark("scaled_rollout_to_2")
    target = killed_at + args.steps_after_kills
    result["recovered"] = until(lambda: newest_version(compose) >= target, args.recover_timeout_s, poll_s=5)
    mark("recovered")
    result["rollout_replicas_healthy"] = until(
        lambda: compose.health().get("rollout", []).count("healthy") >= 2, args.recover_timeout_s)
    result["restarts"] = {name: int(compose.inspect(container, "{{.RestartCount}}"))
                          for name, container in (("learner", learner), ("rollout", rollout))}

    # The replica that was killed may lag a version; the evaluation names what it measured.
    after = compose.exec_json("rollout", "policyloop", "evaluate", "--problems", str(args.eval_problems))
    result["accuracy_after"], result["accuracy_after_version"] = after["accuracy"], after["version"]
    mark("evaluated_after")
    asyncio.run(stop_run(gateway, run_id))
    report = compose.exec_json("gateway", "policyloop", "audit", "--settle-s", str(args.settle_s))
    result["audit"] = {k: report[k] for k in ("generated", "trained", "dropped", "dead_lettered", "pending", "lost",
                                              "trained_twice", "trained_not_generated", "steps",
                                              "versions_monotonic", "settled", "newest_version")}
    result["audit"]["provisional"] = report.get("provisional")  # final figures only at rest (absent: older image)
    mark("audited")
    check = compose.exec_json("sandbox", "policyloop", "sandbox-check", check=False)
    result["sandbox_check"] = {"ok": check.get("ok"), **{p["name"]: p["ok"] for p in check.get("probes", [])}}
    mark("sandbox_checked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="policyloop-smoke", help="compose project name")
    parser.add_argument("--train-s", type=float, default=120, help="training before the kills")
    parser.add_argument("--steps-after-kills", type=int, default=20,
                        help="learner steps past the version at the kills that count as recovered")
    parser.add_argument("--eval-problems", type=int, default=300)
    parser.add_argument("--min-gain", type=float, default=0.05, help="held-out accuracy gain that counts as learning")
    parser.add_argument("--start-timeout-s", type=float, default=1800,
                        help="from `up` to every container healthy, the models job's bootstrap build included "
                             "(about a minute on an idle host, many on a busy 2-core one)")
    parser.add_argument("--recover-timeout-s", type=float, default=900)
    parser.add_argument("--settle-s", type=float, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="leave the cluster up (no teardown)")
    parser.add_argument("--out", type=Path, default=Path("runs/perf/compose_smoke"))
    args = parser.parse_args()
    missing = preflight()
    if missing:
        print("compose_smoke cannot run yet:\n" + "\n".join(f"  - {line}" for line in missing), file=sys.stderr)
        sys.exit(2)
    compose = Compose(args.project, free_port())
    result: dict = {"engine": compose.engine, "project": args.project, "gateway_port": int(compose.env[
        "POLICYLOOP_GATEWAY_PORT"]), "timeline_s": {}}
    started = time.monotonic()
    compose("down", "--volumes", "--remove-orphans", check=False)  # a clean start
    try:
        drive(compose, args, result)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, then torn down
        result["error"] = repr(exc)
    finally:
        if not args.keep:
            compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)
            result["left_behind"] = {"containers": compose.containers(all_states=True), "volumes": compose.volumes()}
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    audit = result.get("audit", {})
    result["accuracy_gain"] = round(result.get("accuracy_after", 0.0) - result.get("accuracy_before", 0.0), 4)
    result["ok"] = bool(
        "error" not in result and result.get("healthy") and result["accuracy_gain"] >= args.min_gain
        and result.get("recovered") and result.get("rollout_replicas_healthy")
        and audit.get("lost") == 0 and audit.get("trained_twice") == 0 and audit.get("trained_not_generated") == 0
        and audit.get("versions_monotonic") and result.get("sandbox_check", {}).get("ok")
        and (args.keep or not any(result["left_behind"].values())))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)  # `make compose-smoke` and scripts fail on a failed run


if __name__ == "__main__":
    main()
