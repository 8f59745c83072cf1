"""The seccomp filter of the code sandbox: classic BPF, built by hand, loaded by bubblewrap.

`deny_filter()` returns the program as the bytes of a `struct sock_filter` array,
which `bwrap --seccomp FD` loads just before it starts the sandboxed program. It
allows every system call except these, which fail with EPERM:
  * namespaces and mounts: unshare, setns, clone with any CLONE_NEW* flag, mount,
    umount2, pivot_root, chroot and the new mount API (open_tree, move_mount,
    fsopen, fsconfig, fsmount, fspick, mount_setattr). clone3, whose flags sit in
    memory a filter cannot read, fails with ENOSYS, so the C library falls back to
    clone, whose flags it can;
  * the kernel keyrings (add_key, request_key, keyctl): not confined by the
    namespaces, so a channel between sandboxes;
  * tracing and other processes' memory: ptrace, process_vm_readv,
    process_vm_writev, perf_event_open;
  * large kernel attack surface a stdin/stdout program has no use for: bpf,
    userfaultfd, io_uring_setup, io_uring_enter, io_uring_register.
A call made with another architecture's convention (the 32-bit `int 0x80` entry on
x86_64) kills the process, and x32 calls fail with ENOSYS, so the numbers above
cannot be dodged. Only x86_64 and aarch64 are known; elsewhere there is no filter.
"""

import functools
import platform
import struct

# Numbers per architecture (linux/arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h); the newest calls share one numbering.
_COMMON = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
           "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
           "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442}
_ARCHES = {
    # machine: (AUDIT_ARCH_*, syscall numbers)
    "x86_64": (0xC000003E, {
        "clone": 56, "ptrace": 101, "pivot_root": 155, "chroot": 161, "mount": 165,
        "umount2": 166, "add_key": 248, "request_key": 249, "keyctl": 250,
        "unshare": 272, "perf_event_open": 298, "setns": 308, "process_vm_readv": 310,
        "process_vm_writev": 311, "bpf": 321, "userfaultfd": 323, **_COMMON}),
    "aarch64": (0xC00000B7, {
        "umount2": 39, "mount": 40, "pivot_root": 41, "chroot": 51, "unshare": 97,
        "ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220,
        "perf_event_open": 241, "setns": 268, "process_vm_readv": 270,
        "process_vm_writev": 271, "bpf": 280, "userfaultfd": 282, **_COMMON}),
}
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree",
          "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
          "add_key", "request_key", "keyctl", "ptrace", "process_vm_readv",
          "process_vm_writev", "perf_event_open", "bpf", "userfaultfd", "io_uring_setup",
          "io_uring_enter", "io_uring_register")
CLONE_NEW_FLAGS = 0x7E020080  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
_X32_BIT = 0x40000000
_EPERM, _ENOSYS = 1, 38

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_NR, _ARCH, _ARG0 = 0, 4, 16  # Offsets in struct seccomp_data (arg 0's low word).


def syscall_numbers() -> dict[str, int] | None:
  """This machine's numbers of the calls the filter knows; None where it has none."""
  arch = _ARCHES.get(platform.machine())
  return None if arch is None else dict(arch[1])


@functools.cache
def deny_filter() -> bytes | None:
  """The filter for this machine's architecture, or None where there is none."""
  if platform.machine() not in _ARCHES:
    return None
  audit_arch, nr = _ARCHES[platform.machine()]
  # (opcode, k, label jumped to when true, label when false); None: next instruction.
  prog = [(_LD_ABS, _ARCH, None, None), (_JEQ, audit_arch, None, "kill"),
          (_LD_ABS, _NR, None, None)]
  if platform.machine() == "x86_64":
    prog.append((_JGE, _X32_BIT, "enosys", None))
  prog.append((_JEQ, nr["clone3"], "enosys", None))
  prog += [(_JEQ, nr[name], "eperm", None) for name in DENIED]
  prog += [(_JEQ, nr["clone"], None, "allow"), (_LD_ABS, _ARG0, None, None),
           (_JSET, CLONE_NEW_FLAGS, "eperm", "allow")]
  returns = {"allow": _ALLOW, "eperm": _ERRNO | _EPERM, "enosys": _ERRNO | _ENOSYS,
             "kill": _KILL_PROCESS}
  at = {label: len(prog) + i for i, label in enumerate(returns)}
  out = []
  for i, (code, k, true, false) in enumerate(prog):
    jt, jf = (0 if label is None else at[label] - i - 1 for label in (true, false))
    out.append(struct.pack("=HBBI", code, jt, jf, k))
  out += [struct.pack("=HBBI", _RET, 0, 0, value) for value in returns.values()]
  return b"".join(out)
