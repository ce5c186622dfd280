/*
 * What the sandbox's static helpers (gate.c, waiter.c) share: an entry point and raw x86-64
 * system calls without libc (a static glibc start-up alone costs ~0.3 ms of CPUID traps on these
 * VMs, and each helper runs once per execution), and the few string helpers they need.
 * Include it after defining TOOL_NAME (a string) and TOOL_FAILURE (an exit status); the tool
 * defines `tool_main(word *stack)`.
 */
#include <asm/unistd.h>

#define EINTR 4
#define EINVAL 22
#define EPERM 1

typedef unsigned long word;

#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n"
        "  xor %ebp, %ebp\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call tool_main\n  hlt\n");

static long sys6(long nr, word a, word b, word c, word d, word e, word f)
{
    register word r10 __asm__("r10") = d;
    register word r8 __asm__("r8") = e;
    register word r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#else
#error "system call stubs for x86-64 only (elsewhere the engine falls back)"
#endif

#define sys(nr, a, b, c) sys6((nr), (word)(a), (word)(b), (word)(c), 0, 0, 0)

static word length(const char *text)
{
    word n = 0;
    while (text[n])
        n++;
    return n;
}

static void say(const char *text)
{
    sys(__NR_write, 2, text, length(text));
}

/* "TOOL_NAME: WHAT: errno N" on stderr, then exit TOOL_FAILURE. */
static void die(const char *what, long err)
{
    char digits[24];
    int at = (int)sizeof digits;
    word value = (word)(err < 0 ? -err : err);
    digits[--at] = '\0';
    do {
        digits[--at] = (char)('0' + value % 10);
        value /= 10;
    } while (value && at > 0);
    say(TOOL_NAME ": ");
    say(what);
    say(": errno ");
    say(digits + at);
    say("\n");
    for (;;)
        sys(__NR_exit_group, TOOL_FAILURE, 0, 0);
}

/* A decimal number without sign, spaces or overflow; anything else ends the gate. */
static word number(const char *text, word max)
{
    word value = 0;
    if (*text == '\0')
        die("empty number", EINVAL);
    for (; *text; text++) {
        word digit = (word)(*text - '0');
        if (*text < '0' || *text > '9' || value > (max - digit) / 10)
            die("bad number", EINVAL);
        value = value * 10 + digit;
    }
    return value;
}

