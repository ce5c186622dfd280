# Status waiter, Perl fallback of waiter.c (where the static one cannot be built): PID 1 of the
# sandbox (bwrap --as-pid-1) and the program's parent. It makes itself non-dumpable, reads the
# per-execution key from its fd and closes it, and when the program ends writes one framed record
# on the status fd: "CRF1", a 4-byte big-endian length, the key, then "EXIT <code>" or
# "SIGNAL <n>" (see workers/sandbox/records.py), and exits with that status. Perl because
# perl-base is Essential on Debian; it adds no isolation of its own.
my ($fd, $key_fd, @cmd) = @ARGV;
require Config;
if ($Config::Config{archname} =~ /^x86_64/) {  # prctl(PR_SET_DUMPABLE, 0): 157 on x86-64 only
    syscall(157, 4, 0, 0, 0, 0) == 0 or die "status waiter: PR_SET_DUMPABLE: $!\n";
}
open(my $out, ">&=", $fd) or die "status waiter: fd $fd: $!\n";
open(my $kin, "<&=", $key_fd) or die "status waiter: key fd $key_fd: $!\n";
my $key = "";
while (length($key) < 16) {
    my $got = sysread($kin, $key, 16 - length($key), length($key));
    die "status waiter: reading the key: $!\n" unless $got;
}
close($kin);
my $pid = fork();
die "status waiter: fork: $!\n" unless defined $pid;
if ($pid == 0) {
    close($out);  # the program gets no handle on the status channel
    # A clean signal state, as waiter.c gives: exec keeps blocked signals and ignored ones.
    require POSIX;
    POSIX::sigprocmask(POSIX::SIG_SETMASK(), POSIX::SigSet->new());
    POSIX::sigaction($_, POSIX::SigAction->new('DEFAULT')) for 1 .. 64;  # KILL, STOP refuse
    exec { $cmd[0] } @cmd;
    print STDERR "cannot run $cmd[0]: $!\n";
    exit 127;
}
while ((my $done = waitpid(-1, 0)) > 0) {
    next if $done != $pid;  # an orphan re-parented to PID 1
    my $status = $?;
    my $sig = $status & 127;
    my $body = $key . ($sig ? "SIGNAL $sig" : "EXIT " . ($status >> 8));
    syswrite($out, "CRF1" . pack("N", length($body)) . $body);
    exit($sig ? 128 + $sig : $status >> 8);
}
exit 125;
