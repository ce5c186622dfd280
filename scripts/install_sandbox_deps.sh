#!/usr/bin/env bash
# Installs what the sandbox engine and its tests need, only when it is missing (idempotent).
#   - bubblewrap: the isolation tool (namespaces, mounts, seccomp hand-off); setpriv (util-linux)
#     drops to the sandbox uid; libseccomp2 is the library PyPI pyseccomp loads
#   - the start-up gate and the status waiter (workers/sandbox/harness/gate.c, waiter.c),
#     compiled with gcc into a root-owned directory; where they cannot be built, dash and setpriv
#     run the fallback gate and perl the fallback waiter (dash and perl are Essential on Debian,
#     checked anyway)
#   - toolchains for the language tests: gcc/g++, Node.js, Go, Java, Rust, Python 3, Ruby, PHP,
#     Lua 5.4
#   - TypeScript compiler from npm, under /opt/crucible/sandbox-toolchains (world-readable and
#     outside the checkout, so the sandbox user can read it wherever the repo is cloned)
#   - the official `openai` Python client and its dependencies for the sandbox's Python
#     (pip --target, under the same folder): agent programs trained through the recording proxy
#     (workers/envs/agent_proxy.py) import it; sessions get it read-only on PYTHONPATH
# The sandbox user must be able to read every toolchain, so Rust comes from Debian even when a
# rustup toolchain lives under /root (unreadable to an unprivileged uid).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
[ -x /usr/bin/rsync ] || need+=(rsync)  # session snapshots: copy only what changed (sessions.py)
[ -x /usr/bin/setpriv ] || need+=(util-linux)
[ -x /usr/bin/dash ] || need+=(dash)
[ -x /usr/bin/perl ] || need+=(perl-base)
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || need+=(libseccomp2)  # for PyPI pyseccomp
[ -x /usr/bin/python3 ] || need+=(python3)
[ -x /usr/bin/gcc ] || need+=(gcc)
[ -x /usr/bin/g++ ] || need+=(g++)
[ -x /usr/bin/node ] || need+=(nodejs)
[ -x /usr/bin/npm ] || need+=(npm)
[ -x /usr/bin/go ] || need+=(golang-go)
[ -x /usr/bin/javac ] || need+=(default-jdk-headless)
[ -x /usr/bin/rustc ] || need+=(rustc)
[ -x /usr/bin/ruby ] || need+=(ruby)
[ -x /usr/bin/php ] || need+=(php-cli)
[ -x /usr/bin/lua5.4 ] || need+=(lua5.4)

if [ ${#need[@]} -gt 0 ]; then
    echo "install_sandbox_deps: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

toolchains=${CRUCIBLE_SANDBOX_TOOLCHAINS:-/opt/crucible/sandbox-toolchains}
tsdir=$toolchains/typescript
if [ ! -x "$tsdir/node_modules/.bin/tsc" ] && command -v npm >/dev/null; then
    echo "install_sandbox_deps: installing TypeScript under $tsdir"
    mkdir -p "$tsdir"
    npm install --silent --no-audit --no-fund --prefix "$tsdir" typescript@5 >/dev/null
fi
pydir=$toolchains/python-openai
OPENAI_PIN=${CRUCIBLE_SANDBOX_OPENAI:-openai>=2,<3}
if [ ! -f "$pydir/.crucible-ok" ] && [ -x /usr/bin/python3 ]; then
    echo "install_sandbox_deps: installing the openai client for the sandbox's Python under $pydir"
    if ! /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-pip >/dev/null
    fi
    rm -rf "$pydir.tmp"
    /usr/bin/python3 -m pip install -q --no-compile --disable-pip-version-check \
        --target "$pydir.tmp" "$OPENAI_PIN"
    /usr/bin/python3 -I -c "import sys; sys.path.insert(0, '$pydir.tmp'); import openai"
    touch "$pydir.tmp/.crucible-ok"
    rm -rf "$pydir" && mv "$pydir.tmp" "$pydir"
fi
chmod -R a+rX "$toolchains" 2>/dev/null || true
# The start-up gate and the status waiter (static, no libc), named after their sources' hash
# (workers/sandbox/gate.py builds them with the system Python: it needs only the standard library).
if [ "$(id -u)" = 0 ]; then
    PYTHONPATH=. /usr/bin/python3 -I -c 'import runpy, sys; sys.path.insert(0, "."); runpy.run_module("workers.sandbox.gate", run_name="__main__")'
fi
chmod a+x /opt/crucible 2>/dev/null || true
echo "install_sandbox_deps: ok"
