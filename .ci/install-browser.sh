#!/usr/bin/env bash
# Install the browser the JupyterLab browser tests drive (tests/test_browser.py).
#
# We use Debian's own `chromium` package and point Playwright at it with
# executable_path. Never run `playwright install`: its browser download is not
# reachable from the machines this course runs on.
#
# Idempotent: does nothing when `chromium` is already on PATH.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "chromium already installed: $(command -v chromium) ($(chromium --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "error: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# Package lists may be missing in fresh containers; refresh when install fails.
if ! $SUDO apt-get install -y --no-install-recommends chromium; then
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends chromium
fi

command -v chromium >/dev/null 2>&1 || { echo "error: chromium still not on PATH" >&2; exit 1; }
echo "installed: $(command -v chromium) ($(chromium --version 2>/dev/null || true))"
