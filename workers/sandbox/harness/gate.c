/*
 * Start-up gate of one sandboxed execution (runs on the host, before bubblewrap).
 *
 *   gate CPU_SECONDS FSIZE_BYTES NOFILE UID GID PROGRAM [ARG...]
 *
 * The supervisor starts it as root with Popen (which stays on vfork), moves it into the
 * execution's cgroup, then writes one line to its stdin. Only then does the gate lower its
 * rlimits (hard and soft: root here lacks CAP_SYS_RESOURCE, so they cannot be set from outside),
 * drop every supplementary group, switch to the unprivileged uid/gid, clear its inheritable and
 * ambient capabilities and exec PROGRAM (bwrap). It reads stdin one byte at a time, so the
 * program's own input, written later on the same pipe, reaches the program intact.
 *
 * It does what `dash -c 'read; ulimit ...; exec setpriv --reuid ... --clear-groups
 * --inh-caps=-all -- bwrap ...'` did, in one process image instead of three. It is built
 * without libc (-nostdlib -ffreestanding, raw system calls, x86-64 only: the one tested): a static glibc
 * start-up alone costs three times the rest of the gate (on these VMs, mostly CPUID traps while
 * it sizes the caches), and the gate runs once per execution. It creates no namespace and
 * grants nothing: isolation stays with bubblewrap and seccomp. Any failure exits 125 before
 * PROGRAM runs.
 */
#include <linux/capability.h>
#include <linux/prctl.h>
#include <linux/resource.h>

#define TOOL_NAME "crucible gate"
#define TOOL_FAILURE 125
#include "nolibc.h"

static void limit(unsigned resource, word value, const char *name)
{
    struct rlimit64 both;
    both.rlim_cur = value;
    both.rlim_max = value;
    long err = sys6(__NR_prlimit64, 0, resource, (word)&both, 0, 0, 0);
    if (err < 0)
        die(name, err);
}

__attribute__((used, noreturn)) void tool_main(word *stack)
{
    long argc = (long)stack[0];
    char **argv = (char **)(stack + 1);
    char **envp = argv + argc + 1;
    long err;

    if (argc < 7)
        die("usage: gate CPU_SECONDS FSIZE_BYTES NOFILE UID GID PROGRAM [ARG...]", EINVAL);
    word cpu = number(argv[1], ~(word)0 - 1);
    word fsize = number(argv[2], ~(word)0 - 1);
    word nofile = number(argv[3], 1u << 20);
    word uid = number(argv[4], 0xfffffffeu);
    word gid = number(argv[5], 0xfffffffeu);

    /* Wait until the supervisor has put this process into its cgroup. */
    for (;;) {
        char c;
        long got = sys(__NR_read, 0, &c, 1);
        if (got == 1 && c == '\n')
            break;
        if (got == 1 || got == -EINTR)
            continue;
        die("waiting for the cgroup", got == 0 ? 32 /* EPIPE */ : got);
    }

    limit(RLIMIT_CPU, cpu, "RLIMIT_CPU");
    limit(RLIMIT_FSIZE, fsize, "RLIMIT_FSIZE");
    limit(RLIMIT_NOFILE, nofile, "RLIMIT_NOFILE");
    limit(RLIMIT_CORE, 0, "RLIMIT_CORE");

    if ((err = sys(__NR_setgroups, 0, 0, 0)) < 0)
        die("setgroups", err);
    if ((err = sys(__NR_setresgid, gid, gid, gid)) < 0)
        die("setresgid", err);
    if ((err = sys(__NR_setresuid, uid, uid, uid)) < 0)
        die("setresuid", err);
    unsigned r = 0, e = 0, s = 0;
    if ((err = sys(__NR_getresuid, &r, &e, &s)) < 0 || r != uid || e != uid || s != uid)
        die("uid did not change", err < 0 ? err : EPERM);
    /* Leaving uid 0 cleared the permitted, effective and ambient sets (no SECBIT_KEEP_CAPS);
     * clear the inheritable set too, and ambient explicitly (EINVAL: a kernel without it). */
    struct __user_cap_header_struct header;
    struct __user_cap_data_struct none[_LINUX_CAPABILITY_U32S_3];
    header.version = _LINUX_CAPABILITY_VERSION_3;
    header.pid = 0;
    for (int i = 0; i < _LINUX_CAPABILITY_U32S_3; i++) {
        none[i].effective = 0;
        none[i].permitted = 0;
        none[i].inheritable = 0;
    }
    if ((err = sys(__NR_capset, &header, none, 0)) < 0)
        die("capset", err);
    err = sys6(__NR_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, 0);
    if (err < 0 && err != -EINVAL)
        die("clearing ambient capabilities", err);

    err = sys(__NR_execve, argv[6], argv + 6, envp);
    die(argv[6], err);
    for (;;)
        ;
}
