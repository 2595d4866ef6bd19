"""Sandbox sessions through the real sandbox service: one isolated process keeps its state across
the steps of an episode, each step and the whole episode have time limits, the session ends when
the caller closes it, and its result says what it used."""

from __future__ import annotations

import urllib.request

import pytest

from policyloop.bus import Bus
from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.runner import JobUids, SandboxUnavailable, check_isolation
from policyloop.sandbox.session import Session, SessionEnded
from tests.conftest import ServiceLauncher
from tests.helpers import eventually

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

# A stateful process: it keeps a running total, sleeps when told to, and tries the network.
COUNTER = b'''
import socket, sys, time
total = 0
for line in sys.stdin:
    word, _, arg = line.strip().partition(" ")
    if word == "add":
        total += int(arg)
        print(total, flush=True)
    elif word == "sleep":
        time.sleep(float(arg))
        print("awake", flush=True)
    elif word == "net":
        try:
            socket.create_connection(("127.0.0.1", int(arg)), timeout=2)
            print("connected", flush=True)
        except OSError as exc:
            print("no network:", type(exc).__name__, flush=True)
    elif word == "exit":
        sys.exit(3)
    elif word == "flood":
        print("x" * 200000, flush=True)
'''


def counter_job(wall_seconds: float = 30.0) -> bus_pb2.SandboxJob:
    return bus_pb2.SandboxJob(job_id="counter", run_id="run-1", files={"counter.py": COUNTER},
                              command=["python3", "-I", "counter.py"],
                              limits=bus_pb2.SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=wall_seconds))


async def test_a_session_keeps_its_state_and_ends_when_closed(bus: Bus, services: ServiceLauncher,
                                                             nats_server) -> None:  # type: ignore[no-untyped-def]
    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=60)
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        assert [await session.step(f"add {n}".encode()) for n in (2, 3, 10)] == [b"2", b"5", b"15"]
        port = int(nats_server.url.rsplit(":", 1)[1])
        assert (await session.step(f"net {port}".encode())).startswith(b"no network")
        result = await session.close()
    assert result is not None and result.exit_code == 0 and not result.error
    assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_NONE and result.cpu_seconds > 0
    assert result.accounting != bus_pb2.SANDBOX_ACCOUNTING_UNSPECIFIED
    # Another episode is another process: nothing of the first one's state.
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        assert await session.step(b"add 1") == b"1"


async def test_a_step_past_its_limit_ends_the_session(bus: Bus, services: ServiceLauncher) -> None:
    sandbox = services.start("sandbox", env={"POLICYLOOP_SESSION_FIRST_STEP_SECONDS": "2"})
    await services.wait_healthy(sandbox, timeout_s=60)
    # A session nobody talks to (its caller gave up, or a redelivery after a sandbox died) is
    # abandoned: killed, its result saying so, rather than left holding a slot for its wall clock.
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as unspoken:
        async def abandoned() -> bool:
            return unspoken.result is not None

        await eventually(abandoned, timeout_s=30, what="the unspoken session abandoned")
    assert unspoken.result.limit_hit == bus_pb2.SANDBOX_LIMIT_ABANDONED
    async with Session(bus, counter_job(), kind="test", step_seconds=1, open_timeout_s=60) as session:
        assert await session.step(b"add 1") == b"1"
        with pytest.raises(SessionEnded, match="STEP_TIME"):
            await session.step(b"sleep 30")
        assert session.result is not None and session.result.limit_hit == bus_pb2.SANDBOX_LIMIT_STEP_TIME
        with pytest.raises(SessionEnded):  # and it stays over
            await session.step(b"add 1")
    # The episode's wall clock bounds it too, however quickly each step answers.
    async with Session(bus, counter_job(wall_seconds=2), kind="test", step_seconds=30, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="WALL_TIME"):
            for _ in range(100):
                await session.step(b"sleep 0.5")
    # A process that exits mid-episode ends it with its exit code.
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="exit code 3"):
            await session.step(b"exit")
    # An answer past the line limit ends it for its output.
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="OUTPUT"):
            await session.step(b"flood")
    # Each session is counted by how it ended.
    with urllib.request.urlopen(f"http://127.0.0.1:{sandbox.ports['http']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    for outcome in ("abandoned", "step_time", "wall_time", "failed", "output"):
        assert f'policyloop_sandbox_sessions_total{{outcome="{outcome}"}} 1.0' in metrics, outcome


def wheel(name: str, version: str, modules: dict[str, str]) -> tuple[str, bytes]:
    """A pure-Python wheel, as a build backend would make it (what a team uploads)."""
    import base64
    import hashlib
    import io
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {**{f"{name}/{m}": body for m, body in modules.items()},
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path, body in files.items():
            zf.writestr(path, body)
            digest = base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(body.encode())}")
        zf.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return f"{name}-{version}-py3-none-any.whl", buffer.getvalue()


async def test_a_session_imports_its_dependencies_installed_once_read_only(bus: Bus, services: ServiceLauncher) -> None:
    import shutil
    import tempfile
    from pathlib import Path

    deps_dir = Path(tempfile.mkdtemp(prefix="policyloop-deps-"))  # below /tmp: the jobs' users can reach it
    deps_dir.chmod(0o755)
    try:
        sandbox = services.start("sandbox", env={"POLICYLOOP_DEPENDENCIES_DIR": str(deps_dir),
                                                 "POLICYLOOP_PACKAGE_INDEX_URL": "none"})
        await services.wait_healthy(sandbox, timeout_s=60)
        name, content = wheel("ledgerlib", "1.0", {"__init__.py": "def balance(entries):\n    return sum(entries)\n"})
        uses = b"import sys\nsys.path.insert(0, '/deps/site-packages')\nimport ledgerlib\nfor line in sys.stdin:\n" \
               b"    try:\n        open('/deps/site-packages/ledgerlib/x', 'w')\n        print('wrote', flush=True)\n" \
               b"    except OSError:\n        print(ledgerlib.balance(map(int, line.split())), flush=True)\n"
        job = bus_pb2.SandboxJob(job_id="deps", run_id="run-1", files={"uses.py": uses},
                                 command=["python3", "-I", "uses.py"],
                                 limits=bus_pb2.SandboxLimits(wall_seconds=60, cpu_seconds=60),
                                 dependencies=bus_pb2.SandboxDependencies(requirements=["ledgerlib==1.0"],
                                                                          wheels={name: content}))
        for _ in range(2):  # the second session finds the set installed
            async with Session(bus, job, kind="test", step_seconds=10, open_timeout_s=120) as session:
                assert await session.step(b"3 4 5") == b"12"  # imported, and not writable
        [installed] = [d for d in deps_dir.iterdir() if not d.name.startswith(".")]
        # Compiled at install by the jobs' Python (they cannot write there), for the path they see.
        [compiled] = installed.glob("ledgerlib/__pycache__/__init__.cpython-*.pyc")
        assert b"/deps/site-packages/ledgerlib/__init__.py" in compiled.read_bytes()
        # A requirement nothing provides (no index here) ends the session with pip's reason.
        missing = bus_pb2.SandboxJob()
        missing.CopyFrom(job)
        missing.dependencies.requirements.append("no-such-package==9.9")
        async with Session(bus, missing, kind="test", step_seconds=10, open_timeout_s=120) as session:
            with pytest.raises(SessionEnded, match="dependencies: pip could not install"):
                await session.step(b"1")
    finally:
        for path in [deps_dir, *deps_dir.rglob("*")]:  # read-only once installed
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(deps_dir, ignore_errors=True)


# A session that prepares once: prepare() runs in the prepared process, each episode in a fork of it.
PREPARED = b'''
import os, sys, time
PREPARED_BY = None

def prepare(tag):
    global PREPARED_BY
    if tag == "broken":
        raise FileNotFoundError("orders.parquet")
    PREPARED_BY = f"{tag}:{os.getpid()}:{time.time_ns()}"
    def episode():
        total = 0
        for line in sys.stdin:
            word, _, arg = line.strip().partition(" ")
            if word == "who":
                print(PREPARED_BY, os.getppid(), flush=True)
            elif word == "add":
                total += int(arg)
                print(total, flush=True)
            elif word == "spin":
                while True:
                    pass
            elif word == "exit":
                return 3
        return 0
    return episode

if __name__ == "__main__":  # run fresh, when the sandbox forks no sessions
    sys.exit(prepare(sys.argv[1])())
'''


def prepared_job(tag: str = "desk", cpu_seconds: float = 30.0) -> bus_pb2.SandboxJob:
    return bus_pb2.SandboxJob(job_id=f"prepared-{tag}", run_id="run-1", files={"prepared.py": PREPARED},
                              command=["python3", "-I", "prepared.py", tag],
                              limits=bus_pb2.SandboxLimits(wall_seconds=30, cpu_seconds=cpu_seconds),
                              session=bus_pb2.SandboxSession(prepared=True))


async def test_prepared_sessions_fork_from_one_process_each_its_own(bus: Bus, services: ServiceLauncher) -> None:
    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=60)
    answers, results = [], []
    for n in range(2):
        async with Session(bus, prepared_job(), kind="test", step_seconds=10, open_timeout_s=60) as session:
            answers.append((await session.step(b"who")).decode())
            assert await session.step(f"add {n + 5}".encode()) == str(n + 5).encode()  # its own state
            results.append(await session.close())
    # Prepared once: both episodes see the same preparation, each in a process of its own.
    assert answers[0].split()[0] == answers[1].split()[0] and answers[0].startswith("desk:")
    for result in results:
        assert result is not None and result.exit_code == 0 and not result.error, result
        assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_NONE and result.cpu_seconds > 0
        assert result.accounting != bus_pb2.SANDBOX_ACCOUNTING_UNSPECIFIED and result.peak_memory_bytes > 0
    # Its own limits and exit code, as any session.
    async with Session(bus, prepared_job(cpu_seconds=1), kind="test", step_seconds=30, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="CPU_TIME"):
            await session.step(b"spin")
    async with Session(bus, prepared_job(), kind="test", step_seconds=10, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="exit code 3"):
            await session.step(b"exit")
    async with Session(bus, prepared_job(), kind="test", step_seconds=1, open_timeout_s=60) as session:
        assert await session.step(b"add 1") == b"1"
        with pytest.raises(SessionEnded, match="STEP_TIME"):
            await session.step(b"spin")
    # A preparation that fails ends the session with its reason.
    async with Session(bus, prepared_job("broken"), kind="test", step_seconds=10, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="FileNotFoundError: orders.parquet"):
            await session.step(b"who")


async def test_without_forked_sessions_each_prepared_session_prepares_afresh(
        bus: Bus, services: ServiceLauncher) -> None:
    sandbox = services.start("sandbox", env={"POLICYLOOP_FORKED_SESSIONS": "false"})
    await services.wait_healthy(sandbox, timeout_s=60)
    preparations = []
    for _ in range(2):
        async with Session(bus, prepared_job(), kind="test", step_seconds=10, open_timeout_s=60) as session:
            preparations.append((await session.step(b"who")).split()[0])
    assert preparations[0] != preparations[1] and all(p.startswith(b"desk:") for p in preparations)


class Steps:
    """A session's exchange without the bus: lines in, the answers kept (sandbox/runner.Conversation)."""

    def __init__(self, *lines: bytes) -> None:
        self.lines, self.answers = lines, []

    async def run(self, stdin, stdout) -> int:  # type: ignore[no-untyped-def]
        for line in self.lines:
            stdin.write(line + b"\n")
            await stdin.drain()
            self.answers.append(await stdout.readline())
        stdin.close()
        return bus_pb2.SANDBOX_LIMIT_NONE


async def test_a_prepared_process_without_cgroups_and_its_end_when_idle() -> None:
    """The runner's side alone, on rlimits: the session's CPU is what its parent reaped, its CPU
    limit the kernel's; past `max_parents` the least recently used idle parent ends; a prepared
    process with no session for `idle_s` ends, its job with it."""
    from policyloop.sandbox.forked import ForkedSessions
    from policyloop.sandbox.runner import JobLimits

    forked = ForkedSessions(instance="t", uids=JobUids(), cgroups=None, idle_s=1.0, max_parents=1)
    limits = JobLimits(wall_seconds=30, cpu_seconds=1)
    try:
        steps = Steps(b"add 2", b"add 3")
        result = await forked.run(prepared_job(), limits, steps)
        assert steps.answers == [b"2\n", b"5\n"] and result.exit_code == 0 and not result.error, result
        assert result.accounting == bus_pb2.SANDBOX_ACCOUNTING_RLIMIT and result.peak_memory_bytes > 0
        result = await forked.run(prepared_job(), limits, Steps(b"spin"))
        assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_CPU_TIME and result.cpu_seconds > 0.5, result
        [first] = forked.parents.values()
        assert not first.ended
        # Another environment's session: a second parent, and the first (idle, one too many) ends.
        other = Steps(b"who")
        assert (await forked.run(prepared_job("other"), limits, other)).exit_code == 0
        assert other.answers[0].startswith(b"other:") and first.ended
        [parent] = forked.parents.values()
        assert parent is not first and not parent.ended

        async def ended() -> bool:
            return not forked.parents and not forked._jobs

        await eventually(ended, timeout_s=30, what="the idle prepared process ended")
        assert not list(forked.directory.iterdir())  # its control socket's directory removed
    finally:
        await forked.close()
