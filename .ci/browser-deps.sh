#!/usr/bin/env bash
# What the dashboard's browser test (tests/browser/) needs on a fresh Debian machine: Debian's
# chromium (the browser) and the playwright Python package (only its driver is used: the test
# launches /usr/bin/chromium through executable_path; no browser is ever downloaded).
# Run as root (or with sudo), with the project's venv active or present in .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! command -v chromium >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq chromium
fi
chromium --version

# the venv's interpreter: the active one, else the project's .venv, else the system python3
PY=python3
if [ -n "${VIRTUAL_ENV:-}" ]; then PY="$VIRTUAL_ENV/bin/python"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
"$PY" -m pip install -q 'playwright>=1.40'
"$PY" -c "import playwright.sync_api; print('playwright driver ready (browser: Debian chromium)')"
