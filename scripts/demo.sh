#!/usr/bin/env bash
# Set up (if needed) and show pffs at work on the embedded default store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pffs demo "$@"
