#!/usr/bin/env bash
# Run bakron's main job (`bakron demo`, built-in default model). On first use it creates .venv/
# and installs bakron[demo] into it; extra arguments go to `bakron demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[demo]"
exec .venv/bin/bakron demo "$@"
