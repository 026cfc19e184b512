#!/usr/bin/env bash
# Debian's Chromium and its driver, which the chat page's tests drive (tests/web); nothing to do
# when both are there. Selenium comes with the dev extra; nothing here downloads a browser build.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends chromium chromium-driver
