#!/usr/bin/env bash
# Installs what the browser tests need on a fresh Debian machine: the distribution's headless
# Chromium, and the Python `playwright` package in the project's venv. Playwright drives
# /usr/bin/chromium through `executable_path`; `playwright install` (which downloads its own
# browser build) is never run. Idempotent: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"

if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
  elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "install-browser: /usr/bin/chromium is missing and this user cannot run apt-get" >&2
    exit 1
  fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi

if ! "$PYTHON" -c "import playwright" >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet "playwright>=1.45"
fi

echo "install-browser: $(/usr/bin/chromium --version 2>/dev/null | head -n1); playwright $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("playwright"))')"
