#!/usr/bin/env bash
# Headless Chromium for tests/test_report_screenshot.py (Debian's package, ~30 s); a no-op
# when chromium is already on PATH. Uses sudo when not root.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium
