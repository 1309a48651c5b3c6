#!/usr/bin/env bash
# Run bakron's main job (`bakron demo`, built-in default model). On first use it creates .venv/
# and installs bakron[demo] into it; extra arguments go to `bakron demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh demo
exec .venv/bin/bakron demo "$@"
