"""The seccomp filter every job runs under (given to bubblewrap with `--seccomp FD`).

It denies (EPERM) the few system calls that let one process of a job take control of another:
`ptrace` (attach to, stop or rewrite any process of the same uid: the job's main process is its
pid namespace's init, and a stopped init would keep the job alive after its main process
exits), `process_vm_readv` and `process_vm_writev` (another process's memory), and `shmget`
(System V shared memory lives on, unmapped and uncounted by any rlimit, until the job's IPC
namespace goes: without a cgroup it would be unbounded memory). Everything else is allowed:
the filter is a denylist, kept small on purpose, beside the namespaces that do the isolating.

A filter checks the architecture of each call first, since a syscall number means something
else under another ABI: calls of a foreign ABI (32-bit x86 on x86_64) kill the process, and
x32 calls on x86_64 (numbers with bit 30 set) are denied. The program is classic BPF
(`struct sock_filter`, native byte order), written out here because it is a dozen instructions;
`job_filter()` is None on a machine whose numbers are not listed (the job then runs without it).
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
LD_ABS_W = 0x20      # BPF_LD | BPF_W | BPF_ABS: A = seccomp_data[k], 32 bits
JEQ_K = 0x15         # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35         # BPF_JMP | BPF_JGE | BPF_K
RET_K = 0x06         # BPF_RET | BPF_K
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_KILL_PROCESS = 0x80000000
NR_OFFSET, ARCH_OFFSET = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "shmget")


@dataclass(frozen=True)
class Abi:
    audit_arch: int              # AUDIT_ARCH_* of the native ABI
    numbers: dict[str, int]      # its syscall numbers
    x32_bit: int | None = None   # x86_64: calls with this bit set are the x32 ABI


ABIS = {
    "x86_64": Abi(0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "shmget": 29},
                  x32_bit=0x40000000),
    "aarch64": Abi(0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "shmget": 194}),
}
ABIS["amd64"] = ABIS["x86_64"]
ABIS["arm64"] = ABIS["aarch64"]

Instruction = tuple[int, int, int, int]  # code, jump if true, jump if false, k


def program(abi: Abi, denied: tuple[str, ...] = DENIED) -> list[Instruction]:
    """The filter's instructions. Jumps are relative to the next instruction; the last three
    instructions are allow, deny and kill."""
    body: list[Instruction] = [(LD_ABS_W, 0, 0, NR_OFFSET)]
    checks: list[tuple[int, int]] = [(JEQ_K, abi.numbers[name]) for name in denied]
    if abi.x32_bit is not None:
        checks.insert(0, (JGE_K, abi.x32_bit))
    for i, (code, k) in enumerate(checks):
        to_deny = len(checks) - i  # past the remaining checks and the allow
        body.append((code, to_deny, 0, k))
    tail: list[Instruction] = [(RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_ERRNO | errno.EPERM),
                               (RET_K, 0, 0, RET_KILL_PROCESS)]
    to_kill = len(body) + 2  # past the body and allow/deny, from the instruction after the arch test
    return [(LD_ABS_W, 0, 0, ARCH_OFFSET), (JEQ_K, 0, to_kill, abi.audit_arch), *body, *tail]


def encode(instructions: list[Instruction]) -> bytes:
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in instructions)


def job_filter(machine: str | None = None) -> bytes | None:
    """The encoded filter for this machine's ABI, or None where its syscall numbers are unknown."""
    abi = ABIS.get((machine or platform.machine()).lower())
    return None if abi is None else encode(program(abi))
