#!/usr/bin/env bash
# Install a headless browser (Debian's `chromium` package) for tests/test_view_run.py, which renders
# the run report (tools/view_run.py) the way a reader's browser does. Needs root (or sudo) and apt.
# Idempotent: does nothing when `chromium` is already on PATH.
#   bash tools/install_chromium.sh        (or: make chromium)
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: no apt-get on this machine; install Chromium (or Google Chrome) yourself" \
         "and put it on PATH as \`chromium\`" >&2
    exit 1
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_chromium.sh: needs root or sudo to run apt-get" >&2; exit 1; }
    sudo=(sudo)
fi
echo "installing chromium with apt-get (first time only)"
"${sudo[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends chromium
command -v chromium >/dev/null 2>&1 || { echo "install_chromium.sh: apt-get finished but \`chromium\` is not on PATH" >&2; exit 1; }
echo "installed $(chromium --version 2>/dev/null || echo chromium)"
