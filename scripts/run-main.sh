#!/usr/bin/env bash
# Set up (the runtime dependencies only), then run the main job: `python -m trainer` trains a tiny LFM2 from scratch on the shipped
# synthetic chat data (a few minutes on lavapipe). Extra arguments go to it (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash scripts/setup.sh
exec .venv/bin/python -m trainer "$@"
