#!/usr/bin/env bash
# Run bakron's test suite. On first use it creates .venv/ and installs bakron[test] into it;
# extra arguments go to pytest (e.g. scripts/test.sh -k reference -x).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh test
exec .venv/bin/python -m pytest "$@"
