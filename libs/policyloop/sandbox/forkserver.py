"""A prepared process that sessions fork from, inside the sandbox (standard library only: it runs
on the jobs' Python, beside the job's files, with nothing of policyloop).

    python3 -I forkserver.py CONTROL_SOCKET SCRIPT ARGS...

Sessions whose process spends most of its time getting ready (a verifiers environment: its
imports and `load_environment` take seconds of CPU, its episode milliseconds) fork from one
process that got ready once. It imports SCRIPT (a path below the job's directory) as a module and
calls its `prepare(*ARGS)`, which returns the episode: a function of no arguments that runs one
episode on stdin/stdout and returns its exit code. It connects to CONTROL_SOCKET (the sandbox's,
bound into the job read-only: a Unix socket needs no network) and says `ready`, then for each
`fork` request, which carries the episode's stdin/stdout (one socket) and its stderr as
descriptors, it forks; the child sends its credentials on its socket (so that the sandbox learns
its pid as the host sees it, from the kernel), waits for the sandbox's go (once it is in its own
cgroup), then runs the episode. Each child that exits is
reported `exited PID STATUS CPU_SECONDS MAXRSS_KB`. It is the init of the job's pid namespace:
it reaps whatever its children leave, and when it exits the kernel ends them all.

A `prepare` that fails is reported `failed REASON` and the process exits 1.
"""

import importlib.util
import math
import os
import resource
import select
import signal
import socket
import struct
import sys
import traceback

MAX_FDS = 2          # a fork request carries the episode's socket and its stderr
GO = b"g"            # the sandbox's word to start the episode
REQUEST_BYTES = 4096


def load(script, args):
    spec = importlib.util.spec_from_file_location("__episode__", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["__episode__"] = module
    spec.loader.exec_module(module)
    return module.prepare(*args)


def send_credentials(sock):
    """The kernel checks and translates them: the sandbox reads the pid its namespace sees."""
    credentials = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    sock.sendmsg([b"\n"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, credentials)])


def child(control, wakeup, episode_sock, stderr_fd, episode):
    """In the forked child: the episode's descriptors as 0, 1 and 2, nothing of the server's."""
    for fd in (control.fileno(), *wakeup):
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    code = 1
    try:
        send_credentials(episode_sock)
        if episode_sock.recv(1) != GO:  # the sandbox has put it in its own cgroup: nothing of it ran before
            os._exit(1)
        os.dup2(episode_sock.fileno(), 0)
        os.dup2(episode_sock.fileno(), 1)
        os.dup2(stderr_fd, 2)
        episode_sock.close()
        os.close(stderr_fd)
        sys.stdin = os.fdopen(0, "r", buffering=1)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        code = episode()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the episode's own failure is its exit code and stderr
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code if isinstance(code, int) else 0)


def reap(control):
    """Reports every child that exited (orphans of the namespace included)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu = usage.ru_utime + usage.ru_stime
        control.sendall(f"exited {pid} {status} {cpu!r} {usage.ru_maxrss}\n".encode())


def serve(control, episode):
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    control.sendall(b"ready\n")
    while True:
        readable, _, _ = select.select([control, wakeup[0]], [], [])
        if wakeup[0] in readable:
            while True:
                try:
                    if not os.read(wakeup[0], 512):
                        break
                except BlockingIOError:
                    break
            reap(control)
        if control not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(control, REQUEST_BYTES, MAX_FDS)
        if not data:
            return 0  # the sandbox is done with this process
        word, _, cpu_seconds = data.decode(errors="replace").strip().partition(" ")
        if word != "fork" or len(fds) != MAX_FDS:
            for fd in fds:
                os.close(fd)
            control.sendall(b"refused\n")
            continue
        episode_sock = socket.socket(fileno=fds[0])
        pid = os.fork()
        if pid == 0:
            if cpu_seconds:  # its own CPU limit (the sandbox's cgroup watchdog, where it has one, comes first)
                _, hard = resource.getrlimit(resource.RLIMIT_CPU)
                limit = math.ceil(float(cpu_seconds))
                if hard == resource.RLIM_INFINITY or limit < hard:
                    resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))
            child(control, wakeup, episode_sock, fds[1], episode)
        episode_sock.close()
        os.close(fds[1])
        control.sendall(f"forked {pid}\n".encode())


def main(argv):
    control_path, script, *args = argv
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.connect(control_path)
    try:
        episode = load(script, args)
    except BaseException as exc:  # noqa: BLE001 - said to the sandbox, which fails the sessions waiting
        traceback.print_exc()
        control.sendall(f"failed {type(exc).__name__}: {exc}".replace("\n", " ")[:2000].encode() + b"\n")
        return 1
    return serve(control, episode)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
