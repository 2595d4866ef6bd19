"""Starts one sandbox job and accounts for every process it leaves behind (jobs without a
cgroup: with one, the cgroup counts the job's CPU and the runner starts bwrap itself, saving the
launcher's start, about 25 ms a job).

Run by the runner as `python -I -S launcher.py CONFIG` (standard library only), outside the
job's namespaces and as the sandbox's own user, so the job cannot reach it. It makes itself a
child subreaper, forks the job's command (bwrap) into a session of its own, in its cgroups and
under its rlimits, and reaps everything until nothing is left (bwrap, and the job's main process
should bwrap die first), so the job's CPU time comes to the sandbox as rusage: its processes and
all they waited for, whatever else the sandbox runs at the same time. (Processes the kernel kills
when the namespace ends are reaped inside it and not counted: a cgroup counts those too, and the
runner's watchdog has seen what they used until then.) Descriptors the runner passes for bwrap
are inherited by it.

Arguments: REPORT_FD PARENT_PID RLIMITS CGROUP_PROCS... -- COMMAND..., where RLIMITS is
`resource:soft:hard` triples joined by commas and CGROUP_PROCS are the cgroup.procs files the job
enters. On SIGUSR1 (the wall clock ran out, or the sandbox is stopping) it kills the job; it dies
with the sandbox process (parent-death signal), and the job with it. The report descriptor is
closed in the job. When all is reaped it writes one line to REPORT_FD: the command's wait status
(or -1) and the user and system CPU seconds of all it reaped. It imports as little as it can
(no json, no signal module: ~20 ms of start instead of ~40): every job pays for it.
"""

import _signal
import ctypes
import os
import resource
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def enter_job(cgroup_procs: list[str], rlimits: list[tuple[int, int, int]]) -> None:
    """In the job's first process, before exec: into its cgroups, under its rlimits (so all it
    starts is inside from its first instruction)."""
    for path in cgroup_procs:
        with open(path, "w") as procs:
            procs.write(str(os.getpid()))
    for which, soft, hard in rlimits:
        resource.setrlimit(which, (soft, hard))


def start(command: list[str], cgroup_procs: list[str], rlimits: list[tuple[int, int, int]]) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGUSR1})  # exec keeps the mask
        os.setsid()
        enter_job(cgroup_procs, rlimits)
        os.execvp(command[0], command)
    except BaseException as exc:  # noqa: BLE001 - the child must never return into the launcher
        os.write(2, f"sandbox launcher: cannot start the job: {exc!r}\n".encode())
    os._exit(127)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    report_fd, parent_pid, rlimit_spec, *cgroup_procs = argv[:split]
    command = argv[split + 1:]
    rlimits = [tuple(int(n) for n in triple.split(":")) for triple in rlimit_spec.split(",") if triple]
    report = int(report_fd)
    os.set_inheritable(report, False)  # the job must not reach the report (closed at exec)
    libc = ctypes.CDLL(None, use_errno=True)
    # Dies with the sandbox process that started it (and bwrap, --die-with-parent, with it).
    if (libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0
            or libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0) != 0):
        os.write(2, b"sandbox launcher: prctl failed\n")
        return 125
    if os.getppid() != int(parent_pid):
        return 125  # the sandbox died before the parent-death signal was armed
    job, reaped_job = 0, False

    def kill_job(signum: int, frame: object) -> None:
        if reaped_job:
            return  # its pid may be another process's by now
        for kill in (os.kill, os.killpg):  # the child itself, or the session it made
            try:
                kill(job, _signal.SIGKILL)
            except ProcessLookupError:
                pass

    # A kill asked for before the job's pid is known waits, blocked, until it is.
    _signal.signal(_signal.SIGUSR1, kill_job)
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGUSR1})
    job = start(command, cgroup_procs, rlimits)  # type: ignore[arg-type]
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGUSR1})
    status, user, system = -1, 0.0, 0.0
    while True:
        try:
            reaped, wait_status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        user += usage.ru_utime
        system += usage.ru_stime
        if reaped == job:
            status, reaped_job = wait_status, True
    os.write(report, f"{status} {user!r} {system!r}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
