# Status waiter for programs run without a bootstrap (compiled languages, bash, TypeScript).
# It is the sandbox's PID 1 (bwrap --as-pid-1) and the program's parent, so it sees the real
# wait status and reports it on the feedback fd as "<tag> EXIT <code>" or "<tag> SIGNAL <n>":
# exit(130) and death by SIGINT differ here, while bwrap's own status folds both into 130.
# As PID 1 it cannot be signalled from inside the namespace, and when it exits the kernel kills
# whatever the program left behind. Perl is used because it is always present on Debian
# (perl-base is essential) and starts in a few milliseconds; it adds no isolation of its own.
my ($fd, $tag, @cmd) = @ARGV;
open(my $out, ">&=", $fd) or die "status waiter: fd $fd: $!\n";
my $pid = fork();
die "status waiter: fork: $!\n" unless defined $pid;
if ($pid == 0) {
    close($out);  # the program gets no handle on the status channel
    exec { $cmd[0] } @cmd;
    print STDERR "cannot run $cmd[0]: $!\n";
    exit 127;
}
while ((my $done = waitpid(-1, 0)) > 0) {
    next if $done != $pid;  # an orphan re-parented to PID 1
    my $status = $?;
    my $sig = $status & 127;
    syswrite($out, $sig ? "$tag SIGNAL $sig\n" : "$tag EXIT " . ($status >> 8) . "\n");
    exit($sig ? 128 + $sig : $status >> 8);
}
exit 125;
