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
 * --inh-caps=-all -- bwrap ...'` did, in one small static executable instead of three dynamic
 * ones (two process images fewer per execution, each costing a dynamic link and libc start-up).
 * It creates no namespace and grants nothing: isolation stays with bubblewrap and seccomp.
 * Any failure exits 125 before PROGRAM runs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

extern char **environ;

static void die(const char *what)
{
    const char *reason = strerror(errno);
    (void)!write(2, "crucible gate: ", 15);
    (void)!write(2, what, strlen(what));
    (void)!write(2, ": ", 2);
    (void)!write(2, reason, strlen(reason));
    (void)!write(2, "\n", 1);
    _exit(125);
}

/* A decimal number without sign, spaces or overflow; anything else ends the gate. */
static unsigned long long number(const char *text, unsigned long long max)
{
    unsigned long long value = 0;
    if (*text == '\0') {
        errno = EINVAL;
        die("empty number");
    }
    for (; *text; text++) {
        if (*text < '0' || *text > '9' || value > (max - (unsigned)(*text - '0')) / 10) {
            errno = EINVAL;
            die("bad number");
        }
        value = value * 10 + (unsigned)(*text - '0');
    }
    return value;
}

static void limit(int resource, rlim_t value, const char *name)
{
    struct rlimit both = {value, value};
    if (setrlimit(resource, &both) != 0)
        die(name);
}

int main(int argc, char **argv)
{
    if (argc < 7) {
        errno = EINVAL;
        die("usage: gate CPU_SECONDS FSIZE_BYTES NOFILE UID GID PROGRAM [ARG...]");
    }
    rlim_t cpu = number(argv[1], RLIM_INFINITY - 1);
    rlim_t fsize = number(argv[2], RLIM_INFINITY - 1);
    rlim_t nofile = number(argv[3], 1u << 20);
    uid_t uid = (uid_t)number(argv[4], 0xfffffffeu);
    gid_t gid = (gid_t)number(argv[5], 0xfffffffeu);

    /* Wait until the supervisor has put this process into its cgroup. */
    for (;;) {
        char c;
        ssize_t got = read(0, &c, 1);
        if (got == 1 && c == '\n')
            break;
        if (got == 1 || (got < 0 && errno == EINTR))
            continue;
        if (got == 0)
            errno = EPIPE;
        die("waiting for the cgroup");
    }

    limit(RLIMIT_CPU, cpu, "RLIMIT_CPU");
    limit(RLIMIT_FSIZE, fsize, "RLIMIT_FSIZE");
    limit(RLIMIT_NOFILE, nofile, "RLIMIT_NOFILE");
    limit(RLIMIT_CORE, 0, "RLIMIT_CORE");

    if (setgroups(0, NULL) != 0)
        die("setgroups");
    if (setresgid(gid, gid, gid) != 0)
        die("setresgid");
    if (setresuid(uid, uid, uid) != 0)
        die("setresuid");
    uid_t r, e, s;
    if (getresuid(&r, &e, &s) != 0 || r != uid || e != uid || s != uid) {
        errno = EPERM;
        die("uid did not change");
    }
    /* Leaving uid 0 cleared the permitted, effective and ambient sets (no SECBIT_KEEP_CAPS);
     * clear the inheritable set too, and ambient explicitly (a no-op where already empty). */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct none[_LINUX_CAPABILITY_U32S_3];
    memset(none, 0, sizeof none);
    if (syscall(SYS_capset, &header, none) != 0)
        die("capset");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        die("clearing ambient capabilities");

    execve(argv[6], argv + 6, environ);
    die(argv[6]);
    return 125;
}
