#!/usr/bin/env bash
# Install Debian packages the test suite needs (`make test` calls this for chromium, tmux and libsimde-dev,
# the native CPU kernels' stand-in for AVX-512, only when they are missing).
# Needs root or passwordless sudo; otherwise says what to run instead.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 PACKAGE..." >&2; exit 2; }
if [ "$(id -u)" -eq 0 ]; then SUDO=""
elif sudo -n true 2>/dev/null; then SUDO="sudo -n"
else
  echo "error: $* missing and this user may not install packages; run \`sudo apt-get install -y $*\`" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "error: $* missing and there is no apt-get here; install them with this system's package manager" >&2
  exit 1
fi
$SUDO apt-get update -q >&2
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "$@" >&2
