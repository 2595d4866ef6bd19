"""A cgroup per sandbox job (cgroup v1: memory, pids, cpuacct): the kernel's own account of what
the job used and which limit refused it.

rlimits bind per process and tell nobody when they fire: a job that hits RLIMIT_AS sees ENOMEM
and RLIMIT_NPROC an EAGAIN, and the sandbox could only guess from the job's stderr (which the job
writes, so it can fake it). A job's cgroup holds every process of the job, bwrap's included, and
counts for the whole tree:
- memory.limit_in_bytes (and memsw, so swap is no way around it) bounds the job's resident
  memory, its /tmp tmpfs included; past it the kernel's OOM killer ends a process of the job and
  counts it in memory.oom_control (`oom_kill`);
- pids.max bounds its tasks (processes and threads); every fork refused for it is counted in
  pids.events (`max`);
- cpuacct.usage is the CPU time of the whole tree in nanoseconds, processes the kernel killed
  included, so the sandbox can bound a job's total CPU, not only each process's.

Job cgroups are made below the cgroup this process is in (each controller's hierarchy), in a
directory of this process's own (`policyloop-sandbox-<pid>`), and removed when the job ends.
cgroup v2 is not supported yet: on a v2-only host the sandbox runs on rlimits alone
(JobAccounting.RLIMIT).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)

CONTROLLERS = ("memory", "pids", "cpuacct")
# Tasks bwrap itself adds to a job: its own process outside the job's pid namespace (the job's
# main process is that namespace's init, `--as-pid-1`).
BWRAP_TASKS = 1


class CgroupsUnavailable(RuntimeError):
    """This process cannot make job cgroups (no v1 hierarchy for a controller, or no write access)."""


@dataclass(frozen=True)
class CgroupUsage:
    cpu_seconds: float
    peak_memory_bytes: int
    oom_kills: int          # processes the OOM killer ended for the memory limit
    forks_refused: int      # forks refused for the task limit


def _v1_mounts(mountinfo: str) -> dict[str, tuple[Path, str]]:
    """controller → (mount point, root of the mount) for each cgroup v1 hierarchy."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, extra = fields.split(), tail.split()
        if len(parts) < 5 or len(extra) < 3 or extra[0] != "cgroup":
            continue
        for option in extra[2].split(","):
            mounts.setdefault(option, (Path(parts[4]), parts[3]))
    return mounts


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """controller → this process's cgroup path in that hierarchy (from /proc/self/cgroup)."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if controller:
                paths[controller] = path
    return paths


def job_parents(mountinfo: str, proc_cgroup: str, name: str) -> dict[str, Path]:
    """controller → the directory job cgroups go in: `name` below this process's own cgroup.
    Raises CgroupsUnavailable when a controller has no v1 hierarchy visible here."""
    mounts, own = _v1_mounts(mountinfo), _own_paths(proc_cgroup)
    parents: dict[str, Path] = {}
    for controller in CONTROLLERS:
        if controller not in mounts or controller not in own:
            raise CgroupsUnavailable(f"no cgroup v1 hierarchy with the {controller} controller here")
        mount_point, mount_root = mounts[controller]
        relative = os.path.relpath(own[controller], mount_root)
        if relative.startswith(".."):
            raise CgroupsUnavailable(f"this process's {controller} cgroup {own[controller]} is outside "
                                     f"the mounted part of the hierarchy ({mount_root})")
        parents[controller] = (mount_point / relative).resolve() / name
    return parents


class JobCgroups:
    """Makes, reads and removes the cgroups of jobs (one per job, in each controller)."""

    def __init__(self, parents: dict[str, Path]) -> None:
        self.parents = parents

    @classmethod
    def for_this_process(cls) -> JobCgroups:
        """Job cgroups below this process's own; raises CgroupsUnavailable when it cannot make
        them (a probe cgroup is made and removed in every controller)."""
        parents = job_parents(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text(),
                              f"policyloop-sandbox-{os.getpid()}")
        cgroups = cls(parents)
        cgroups.remove_stale()
        try:
            probe = cgroups.create("probe", memory_bytes=64 * 1024**2, max_tasks=8)
            probe.remove()
        except OSError as exc:
            raise CgroupsUnavailable(f"cannot make job cgroups: {exc}") from exc
        return cgroups

    def create(self, job_name: str, *, memory_bytes: int, max_tasks: int) -> JobCgroup:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_name)[:80] or "job"
        made: list[Path] = []
        try:
            for parent in self.parents.values():
                parent.mkdir(exist_ok=True)
                directory = parent / safe
                directory.mkdir()
                made.append(directory)
            cgroup = JobCgroup({c: p / safe for c, p in self.parents.items()})
            cgroup.write("memory", "memory.limit_in_bytes", memory_bytes)
            if (cgroup.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():
                cgroup.write("memory", "memory.memsw.limit_in_bytes", memory_bytes)
            cgroup.write("pids", "pids.max", max_tasks)
        except BaseException:
            for directory in made:
                _rmdir(directory)
            raise
        return cgroup

    def remove_parents(self) -> None:
        """Removes this process's directories (at shutdown); one still busy is left and logged."""
        for parent in self.parents.values():
            try:
                _rmdir(parent)
            except OSError as exc:
                log.warning("cgroup_not_removed", cgroup=str(parent), error=repr(exc))

    def remove_stale(self) -> None:
        """Ends what sandboxes no longer running left behind (killed, they could not clean up):
        the jobs still in their cgroups are killed (a job can outlive a sandbox killed while it
        was being started), then the cgroups are removed."""
        stale: list[Path] = []
        for parent in self.parents.values():
            prefix = parent.name.rpartition("-")[0] + "-"
            for sibling in parent.parent.glob(prefix + "*"):
                pid = sibling.name.removeprefix(prefix)
                if sibling != parent and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    stale.append(sibling)
        for sibling in stale:
            for job in (d for d in sibling.iterdir() if d.is_dir()):
                _kill_tasks(job / "cgroup.procs")
        for sibling in stale:
            for directory in [*(d for d in sibling.iterdir() if d.is_dir()), sibling]:
                try:
                    _rmdir(directory)
                except OSError as exc:
                    log.warning("cgroup_not_removed", cgroup=str(directory), error=repr(exc))


class JobCgroup:
    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs
        # The job's first process writes its pid to these between fork and exec (launcher.enter_job),
        # so everything the job starts is inside from its first instruction.
        self.procs_files = [str(d / "cgroup.procs") for d in dirs.values()]

    def write(self, controller: str, name: str, value: int) -> None:
        (self.dirs[controller] / name).write_text(str(value))

    def _read(self, controller: str, name: str) -> str:
        return (self.dirs[controller] / name).read_text()

    def cpu_seconds(self) -> float:
        return int(self._read("cpuacct", "cpuacct.usage")) / 1e9

    def forks_refused(self) -> int:
        return _keyed(self._read("pids", "pids.events")).get("max", 0)

    def usage(self) -> CgroupUsage:
        oom = _keyed(self._read("memory", "memory.oom_control")).get("oom_kill", 0)
        return CgroupUsage(cpu_seconds=self.cpu_seconds(),
                           peak_memory_bytes=int(self._read("memory", "memory.max_usage_in_bytes")),
                           oom_kills=oom, forks_refused=self.forks_refused())

    def kill(self) -> None:
        """SIGKILLs every process still in the job (bwrap's pid namespace normally takes them all
        down with it; this covers what it would not)."""
        _kill_tasks(self.dirs["pids"] / "cgroup.procs")

    def remove(self) -> None:
        self.kill()
        for directory in self.dirs.values():
            _rmdir(directory)


def _kill_tasks(procs: Path) -> None:
    """SIGKILLs the processes listed in a cgroup.procs file until it lists none."""
    for _ in range(50):
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except FileNotFoundError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _keyed(text: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            values[key] = int(value)
    return values


def _rmdir(directory: Path) -> None:
    """A cgroup can be removed once its last task is gone, which lags the task's exit a little."""
    for attempt in range(100):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == 99:
                raise
            time.sleep(0.01)


def job_cgroups(mode: str = "auto") -> JobCgroups | None:
    """Job cgroups below this process's own: `auto` where it can make them (None elsewhere, said in
    the log), `required` or CgroupsUnavailable, `off` never."""
    if mode == "off":
        return None
    try:
        return JobCgroups.for_this_process()
    except CgroupsUnavailable as exc:
        if mode == "required":
            raise
        log.warning("sandbox_without_cgroups", reason=str(exc),
                    consequence="limits per process; memory and process limits read from the job's stderr")
        return None
