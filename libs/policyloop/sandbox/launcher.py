"""Starts one sandbox job and accounts for every process it leaves behind.

Run by the runner as `python -I -S launcher.py CONFIG` (standard library only), outside the
job's namespaces and as the sandbox's own user, so the job cannot reach it. It makes itself a
child subreaper, forks the job's command (bwrap) into a session of its own, in its cgroups and
under its rlimits, and reaps everything until nothing is left: bwrap's outer process exits
without reaping the pid namespace's init, so the job's CPU time would otherwise go to whoever
reaps that init (the host's init), not to the sandbox. Reaping it here gives the job's rusage:
its processes and all they waited for, whatever else the sandbox runs at the same time. (Processes
the kernel kills when the namespace ends are reaped inside it and not counted: a cgroup counts
those too.)

CONFIG (JSON): command, report_fd, parent_pid, cgroup_procs (cgroup.procs files to enter),
rlimits ([resource, soft, hard] triples). On SIGUSR1 (the wall clock ran out, or the sandbox is
stopping) it kills the job; it dies with the sandbox process (parent-death signal), and the job
with it. The report descriptor is closed in the job. When all is reaped it writes one JSON line to
report_fd: the command's wait status and the user and system CPU seconds of all it reaped.
"""

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def start(command: list[str], cgroup_procs: list[str], rlimits: list[list[int]]) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # exec keeps the mask
        os.setsid()
        for path in cgroup_procs:
            with open(path, "w") as procs:
                procs.write(str(os.getpid()))
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))
        os.execvp(command[0], command)
    except BaseException as exc:  # noqa: BLE001 - the child must never return into the launcher
        os.write(2, f"sandbox launcher: cannot start the job: {exc!r}\n".encode())
    os._exit(127)


def main() -> int:
    config = json.loads(sys.argv[1])
    report_fd = config["report_fd"]
    os.set_inheritable(report_fd, False)  # the job must not reach the report (closed at exec)
    libc = ctypes.CDLL(None, use_errno=True)
    # Dies with the sandbox process that started it (and bwrap, --die-with-parent, with it).
    if (libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0
            or libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0):
        os.write(2, b"sandbox launcher: prctl failed\n")
        return 125
    if os.getppid() != config["parent_pid"]:
        return 125  # the sandbox died before the parent-death signal was armed
    job = 0

    def kill_job(signum: int, frame: object) -> None:
        for kill in (os.kill, os.killpg):  # the child itself, or the session it made
            try:
                kill(job, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # A kill asked for before the job's pid is known waits, blocked, until it is.
    signal.signal(signal.SIGUSR1, kill_job)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    job = start(config["command"], config["cgroup_procs"], config["rlimits"])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    status, user, system = None, 0.0, 0.0
    while True:
        try:
            reaped, wait_status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        user += usage.ru_utime
        system += usage.ru_stime
        if reaped == job:
            status = wait_status
    os.write(report_fd, (json.dumps({"status": status, "user_s": user, "system_s": system}) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
