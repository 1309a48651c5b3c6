#!/usr/bin/env bash
# Run bakron's test suite. On first use it creates .venv/ and installs bakron[test] into it;
# extra arguments go to pytest (e.g. scripts/test.sh -k reference -x).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
exec .venv/bin/python -m pytest "$@"
