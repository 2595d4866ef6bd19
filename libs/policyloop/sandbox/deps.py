"""Python dependencies of sandbox jobs and sessions: installed once per distinct set into a
directory of their own, which jobs see read-only at /deps/site-packages.

A set is keyed by its requirements, its wheels' contents and the sandbox's Python version. The
installer is pip, run by the sandbox service outside any job, with `--only-binary :all:`: wheels
are unpacked, never built, so no code of a dependency runs at install time (an sdist is refused).
Requirements resolve against the configured package index (none: only the uploaded wheels) and
the uploaded wheels. The directory is made under a temporary name and renamed into place, so a
replica that dies mid-install leaves nothing half-installed, and replicas sharing the directory
agree on it; it is read-only once there.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path, PurePosixPath

from policyloop.contracts.v1 import bus_pb2
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)
MOUNT = "/deps/site-packages"  # where jobs see their dependencies
# (a path with "site-packages" in it: libraries such as dill pickle modules from anywhere else by value)
SANDBOX_PYTHON = "/usr/bin/python3"  # the Python jobs run (the sandbox shows them /usr only)


class DependenciesFailed(RuntimeError):
    """The set could not be installed (pip's reason, or a wheel that is not one)."""


def dependency_key(deps: bus_pb2.SandboxDependencies, python_version: str) -> str:
    digest = hashlib.sha256(python_version.encode())
    for requirement in sorted(deps.requirements):
        digest.update(b"r\0" + requirement.encode() + b"\0")
    for name in sorted(deps.wheels):
        digest.update(b"w\0" + name.encode() + b"\0" + hashlib.sha256(deps.wheels[name]).digest())
    return digest.hexdigest()[:32]


def sandbox_python_version(python: str = SANDBOX_PYTHON) -> str:
    """"3.11": the minor version of the Python jobs run, which wheels are chosen for."""
    done = subprocess.run([python, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


class DependencyInstaller:
    """Installs dependency sets under `root` (one directory each) with pip."""

    def __init__(self, root: Path, *, index_url: str = "", timeout_s: float = 600.0,
                 python_version: str | None = None) -> None:
        self.root, self.index_url, self.timeout_s = Path(root), index_url, timeout_s
        self._python_version = python_version
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def python_version(self) -> str:
        """The jobs' Python version, asked of it at the first set (not when the sandbox starts)."""
        if self._python_version is None:
            self._python_version = sandbox_python_version()
        return self._python_version

    async def directory(self, deps: bus_pb2.SandboxDependencies) -> Path:
        """The set's directory, installed first if this replica has not yet."""
        key = dependency_key(deps, self.python_version)
        target = self.root / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if not target.is_dir():
                await asyncio.to_thread(self._install, deps, target)
        return target

    def _install(self, deps: bus_pb2.SandboxDependencies, target: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # jobs run as users of their own: the bind needs the path readable
        work = self.root / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        wheels = work / "wheels"
        wheels.mkdir(parents=True)
        try:
            paths = []
            for name, content in sorted(deps.wheels.items()):
                if PurePosixPath(name).name != name or not name.endswith(".whl"):
                    raise DependenciesFailed(f"wheels: {name!r} is not a wheel's file name")
                (wheels / name).write_bytes(content)
                paths.append(str(wheels / name))
            command = [sys.executable, "-m", "pip", "install", "--target", str(work / "site"), "--only-binary", ":all:",
                       "--python-version", self.python_version, "--no-compile", "--disable-pip-version-check",
                       "--no-input", "--find-links", str(wheels), *(["--no-index"] if self.index_url == "none" else []),
                       *(["--index-url", self.index_url] if self.index_url not in ("", "none") else []),
                       *deps.requirements, *paths]
            done = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout_s,
                                  env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
                asked = [*deps.requirements, *sorted(deps.wheels)]
                raise DependenciesFailed(f"pip could not install {asked}: {tail}")
            # Compiled by the jobs' own Python: the directory is read-only to them, and a package
            # imported from source each time costs seconds per session (verifiers: ~7 s, ~3 s compiled).
            subprocess.run([SANDBOX_PYTHON, "-m", "compileall", "-q", "-j", "0", "-d", MOUNT, str(work / "site")],
                           capture_output=True, timeout=self.timeout_s)
            _read_only(work / "site")
            try:
                (work / "site").rename(target)
            except OSError:
                if not target.is_dir():  # another replica put the same set in place first: theirs is as good
                    raise
            log.info("dependencies_installed", key=target.name, requirements=list(deps.requirements),
                     wheels=sorted(deps.wheels))
        except subprocess.TimeoutExpired as exc:
            raise DependenciesFailed(f"pip did not finish within {self.timeout_s}s") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _read_only(directory: Path) -> None:
    """Readable by every job's user, writable by none."""
    for path in [directory, *directory.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, 0o555 if path.is_dir() else 0o444)
