#!/usr/bin/env bash
# Set up (with the test references: torch, transformers, peft), then run the test suite on every core
# (pytest-xdist, one worker per core); extra arguments go to pytest
# (e.g. -k cli, -x; -n 0 runs it in one process); the 25 slowest tests are listed at the end.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q -n auto --durations=25 "$@"
