"""The seccomp filter every sandboxed process runs under, built with libseccomp (pyseccomp).

Namespaces already isolate most of the kernel; the filter closes what they do not: socket families
that are not namespaced (AF_VSOCK reaches the hypervisor), the kernel keyring, io_uring (a
recurring source of escapes), tracing other processes or taking their file descriptors (the
status waiter's channel), new namespaces and mounts, eBPF and perf.
Everything else is allowed so ordinary toolchains (JVM, Go, rustc) run unmodified.
"""

from __future__ import annotations

import errno
import os
import socket
import threading

import pyseccomp as sc

DENIED_SYSCALLS: tuple[str, ...] = (
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # Reaching into another process: tracing it, its memory, its file descriptors (pidfd_getfd
    # duplicated the status waiter's fd), or a pidfd to do so with.
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "pidfd_open",
    "process_madvise", "process_mrelease",
    "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "unshare", "setns",
    "bpf", "perf_event_open", "userfaultfd",
    "open_by_handle_at", "name_to_handle_at",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "vhangup",
    "ioperm", "iopl", "lookup_dcookie",
)

# clone() flags that would create a namespace; each is refused on its own bit.
_NAMESPACE_FLAGS: tuple[int, ...] = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

_cache: dict[bool, bytes] = {}
_lock = threading.Lock()


def build_filter(inet: bool = False) -> sc.SyscallFilter:
    """The filter as a libseccomp object (default: allow; listed calls fail with an errno).
    `inet` also allows AF_INET sockets: for a session whose egress policy lends it the proxy
    in its own network namespace, where only that namespace's loopback exists."""
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            continue  # a syscall this architecture does not have
    # Only AF_UNIX sockets: no inet (empty netns anyway), no vsock, netlink, packet, alg...
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    if inet:  # AF_UNIX (1) and AF_INET (2): refuse everything below and above the pair
        assert (socket.AF_UNIX, socket.AF_INET) == (1, 2)
        f.add_rule(no_family, "socket", sc.Arg(0, sc.LT, socket.AF_UNIX))
        f.add_rule(no_family, "socket", sc.Arg(0, sc.GT, socket.AF_INET))
    else:
        f.add_rule(no_family, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(no_family, "socketpair", sc.Arg(0, sc.NE, socket.AF_UNIX))
    for flag in _NAMESPACE_FLAGS:
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory a filter cannot read: fail it so libc falls back to clone.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    return f


def filter_bpf(inet: bool = False) -> bytes:
    """The compiled BPF program, built once per process (bwrap --seccomp reads it from an fd)."""
    with _lock:
        if inet not in _cache:
            fd = os.memfd_create("crucible-seccomp")
            try:
                with os.fdopen(os.dup(fd), "w+b") as fh:
                    build_filter(inet).export_bpf(fh)
                os.lseek(fd, 0, os.SEEK_SET)
                chunks = []
                while chunk := os.read(fd, 65536):
                    chunks.append(chunk)
                _cache[inet] = b"".join(chunks)
            finally:
                os.close(fd)
        return _cache[inet]


def filter_fd(inet: bool = False) -> int:
    """A fresh readable fd holding the filter; the caller passes it to bwrap and closes it."""
    fd = os.memfd_create("crucible-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_bpf(inet))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
