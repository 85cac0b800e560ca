#!/usr/bin/env bash
# Set up, then run the main job (for now the kernel demo: every shipped kernel checked against numpy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash scripts/setup.sh
exec .venv/bin/python -m lfm2jit.demo "$@"
