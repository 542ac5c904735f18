#!/usr/bin/env bash
# Install fedbasin and everything it needs (CPU PyTorch wheel first, then the project + dev extras).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
# flwr 1.42 needs a newer certifi than some registries carry; 1.41 works everywhere we run.
"$PY" -m pip install --quiet --disable-pip-version-check "flwr[simulation]==1.41.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
