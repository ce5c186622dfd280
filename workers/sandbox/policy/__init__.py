"""Security policy of a sandbox: the seccomp filter and the bubblewrap command line."""
