#!/usr/bin/env bash
# Installs what the test suite needs beyond Python packages and the sandbox's toolchains
# (scripts/install_sandbox_deps.sh), only when it is missing (idempotent; instant when present):
#   - Debian's chromium, which the browser tests drive through Playwright at /usr/bin/chromium
#     (never `playwright install`: it downloads a browser build, which fails offline)
#   - promtool, which checks and unit-tests deploy/prometheus/alerts.yml: taken out of Debian's
#     prometheus package into /opt/crucible/prometheus (installing the package would also set
#     up and start a Prometheus server)
# Without root it cannot install: it says what to run and carries on, so the suite still runs
# and names what it skipped (under CI=true those skips fail the run; see tests/skips.py).
set -euo pipefail

need=()
[ -x /usr/bin/chromium ] || need+=(chromium)

if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install_test_deps: missing ${need[*]}; install it as root:" \
             "apt-get install -y ${need[*]}" >&2
        exit 0
    fi
    echo "install_test_deps: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
PROMTOOL=/opt/crucible/prometheus/promtool
if [ ! -x "$PROMTOOL" ] && [ "$(id -u)" = 0 ]; then
    echo "install_test_deps: extracting promtool from Debian's prometheus package"
    tmp=$(mktemp -d)
    chmod 755 "$tmp"  # apt's download sandbox user must be able to write here
    if ! (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); then
        apt-get update -qq
        (cd "$tmp" && apt-get download -qq prometheus >/dev/null)
    fi
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
    install -D -m 0755 "$tmp/x/usr/bin/promtool" "$PROMTOOL"
    rm -rf "$tmp"
fi
echo "install_test_deps: ok"
