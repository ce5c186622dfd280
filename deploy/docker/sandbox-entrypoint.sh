#!/bin/sh
# Entrypoint of the sandbox worker image (runs as root). On cgroup v2 with a private cgroup
# namespace the container's processes sit in the root of its cgroup tree, and the kernel refuses
# to enable controllers for children of a cgroup that has processes of its own ("no internal
# processes"); the sandbox needs memory and pids enabled for its per-execution cgroups
# (workers/sandbox/cgroups.py: v2_parent). So, as Docker-in-Docker's entrypoint does, move every
# process into a leaf cgroup `init` first. On cgroup v1 (separate memory/pids/cpuacct
# hierarchies) there is nothing to do. Then exec the command.
set -eu
root=/sys/fs/cgroup
if [ -f "$root/cgroup.controllers" ] && [ -w "$root/cgroup.subtree_control" ]; then
    mkdir -p "$root/init"
    # A process may exit between the read and the write: ignore those.
    xargs -rn1 < "$root/cgroup.procs" > "$root/init/cgroup.procs" 2>/dev/null || true
    for c in memory pids cpu; do
        if grep -qw "$c" "$root/cgroup.controllers"; then
            echo "+$c" > "$root/cgroup.subtree_control" 2>/dev/null \
                || echo "sandbox-entrypoint: could not enable the $c controller" >&2
        fi
    done
fi
exec "$@"
