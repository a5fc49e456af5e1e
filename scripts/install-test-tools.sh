#!/usr/bin/env bash
# Installs what the test suite needs and pip cannot: Debian's chromium (the browser tests), spin
# (the model checker, with the C compiler it builds its verifiers with) and promtool (package
# prometheus: it checks the alert rules). Only what is missing is installed; the package index is refreshed once.
# Without root and without sudo, it says what is missing and carries on: those tests then skip
# locally and fail under CI=true, which is where a missing tool must be noticed.
set -uo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v spin >/dev/null 2>&1 || missing+=(spin)
command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-test-tools: chromium, spin, a C compiler and promtool are installed"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install-test-tools: missing ${missing[*]} (not root, no sudo): install them as root;" \
    "the tests that need them skip locally and fail under CI=true"
  exit 0
fi

echo "install-test-tools: installing ${missing[*]}"
if ! "${as_root[@]}" apt-get update -qq \
  || ! "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; then
  echo "install-test-tools: installing ${missing[*]} failed;" \
    "the tests that need them skip locally and fail under CI=true"
fi
exit 0
