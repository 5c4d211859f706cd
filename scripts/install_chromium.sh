#!/usr/bin/env bash
# Install Debian's headless-capable `chromium` for the report's browser tests (`make test` calls this only
# when no Chromium is on PATH and $CHROMIUM is unset). Needs root or passwordless sudo; says what to do if not.
set -euo pipefail
if [ "$(id -u)" -eq 0 ]; then SUDO=""
elif sudo -n true 2>/dev/null; then SUDO="sudo -n"
else
  echo "error: Chromium is missing and this user may not install it; run \`sudo apt-get install -y chromium\`" \
       "or set \$CHROMIUM to a Chromium/Chrome binary" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "error: Chromium is missing and there is no apt-get here; install Chromium and set \$CHROMIUM" >&2
  exit 1
fi
$SUDO apt-get update -q >&2
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >&2
