/*
 * Status waiter: PID 1 of every sandbox (bwrap --as-pid-1), and the parent of its program.
 *
 *   waiter STATUS_FD KEY_FD PROGRAM [ARG...]
 *
 * It makes itself non-dumpable (so nothing in the sandbox may open /proc/1/fd, /proc/1/mem or
 * /proc/1/environ: that needs CAP_SYS_PTRACE, which nothing in the sandbox has), reads the
 * per-execution key from KEY_FD and closes it, marks STATUS_FD close-on-exec, then forks the
 * program, with every signal unblocked and at its default action. When the program ends it
 * writes one record on STATUS_FD, in the framing of
 * workers/sandbox/records.py:
 *
 *   "CRF1" <4-byte big-endian length> <16-byte key> "EXIT <code>" | "SIGNAL <n>"
 *
 * and exits with the same status (128 + N for a signal), which takes the whole PID namespace
 * with it. As PID 1 it cannot be signalled from inside the namespace, and it reaps orphans.
 * The program never holds STATUS_FD or the key, the key is not on any command line, and the
 * record is written in one write(2) well under PIPE_BUF, so it is never interleaved with anything
 * else: the supervisor can end the run on it at once, before the namespace is torn down.
 * No libc (see nolibc.h); any failure before the program starts exits 125.
 */
#include <linux/prctl.h>

#define TOOL_NAME "crucible waiter"
#define TOOL_FAILURE 125
#include "nolibc.h"

#define KEY_BYTES 16
#define F_SETFD 2
#define FD_CLOEXEC 1
#define ECHILD 10

static int decimal(char *out, word value)
{
    char digits[24];
    int n = 0, at = 0;
    do {
        digits[n++] = (char)('0' + value % 10);
        value /= 10;
    } while (value);
    while (n)
        out[at++] = digits[--n];
    return at;
}

__attribute__((used, noreturn)) void tool_main(word *stack)
{
    long argc = (long)stack[0];
    char **argv = (char **)(stack + 1);
    char **envp = argv + argc + 1;
    unsigned char key[KEY_BYTES];
    long err;

    if (argc < 4)
        die("usage: waiter STATUS_FD KEY_FD PROGRAM [ARG...]", EINVAL);
    word status_fd = number(argv[1], 1u << 20);
    word key_fd = number(argv[2], 1u << 20);
    if ((err = sys6(__NR_prctl, PR_SET_DUMPABLE, 0, 0, 0, 0, 0)) < 0)
        die("PR_SET_DUMPABLE", err);
    for (word got = 0; got < KEY_BYTES;) {
        long n = sys(__NR_read, key_fd, key + got, KEY_BYTES - got);
        if (n == -EINTR)
            continue;
        if (n <= 0)
            die("reading the key", n == 0 ? EINVAL : n);
        got += (word)n;
    }
    sys(__NR_close, key_fd, 0, 0);
    if ((err = sys(__NR_fcntl, status_fd, F_SETFD, FD_CLOEXEC)) < 0)
        die("status fd", err);

    long child = sys(__NR_fork, 0, 0, 0);
    if (child < 0)
        die("fork", child);
    if (child == 0) {
        /* The program starts with a clean signal state, whatever the engine's process chain
         * had: execve keeps blocked signals and ignored dispositions, so a supervisor with
         * SIGINT blocked (Ray's child processes block it) made raise(SIGINT) a no-op and a
         * program that should die of it "exited 0". Unblock every signal, and give every one
         * its default action (a zeroed kernel sigaction is SIG_DFL, no flags, no mask;
         * SIGKILL and SIGSTOP refuse and need nothing). */
        word sigset = 0;
        word action[4] = {0, 0, 0, 0};
        sys6(__NR_rt_sigprocmask, 2 /* SIG_SETMASK */, (word)&sigset, 0, sizeof sigset, 0, 0);
        for (word signo = 1; signo <= 64; signo++)
            sys6(__NR_rt_sigaction, signo, (word)action, 0, sizeof sigset, 0, 0);
        err = sys(__NR_execve, argv[3], argv + 3, envp);
        say("cannot run ");
        say(argv[3]);
        say("\n");
        for (;;)
            sys(__NR_exit_group, 127, 0, 0);
    }
    for (;;) {
        int status = 0;
        long done = sys6(__NR_wait4, (word)-1, (word)&status, 0, 0, 0, 0);
        if (done == -EINTR || (done > 0 && done != child))
            continue; /* an orphan re-parented to PID 1 */
        if (done < 0)
            die("wait4", done);
        int sig = status & 0x7f;
        int code = (status >> 8) & 0xff;
        char record[64];
        int at = 8;
        for (int i = 0; i < KEY_BYTES; i++)
            record[at++] = (char)key[i];
        const char *kind = sig ? "SIGNAL " : "EXIT ";
        for (; *kind; kind++)
            record[at++] = *kind;
        at += decimal(record + at, (word)(sig ? sig : code));
        word size = (word)(at - 8);
        record[0] = 'C';
        record[1] = 'R';
        record[2] = 'F';
        record[3] = '1';
        record[4] = (char)(size >> 24);
        record[5] = (char)(size >> 16);
        record[6] = (char)(size >> 8);
        record[7] = (char)size;
        sys(__NR_write, status_fd, record, (word)at);
        for (;;)
            sys(__NR_exit_group, sig ? 128 + sig : code, 0, 0);
    }
}
