#!/usr/bin/env bash
# The directory's tests also run on PostgreSQL: make sure the server binaries exist.
set -euo pipefail
if compgen -G "/usr/lib/postgresql/*/bin/initdb" > /dev/null || command -v initdb > /dev/null; then
  exit 0
fi
echo "PostgreSQL server not found; installing it from Debian packages"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql > /dev/null
