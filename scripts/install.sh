#!/usr/bin/env bash
# Install fedbasin and everything it needs: PyTorch first (on the project's machines the pinned
# version resolves to a local CPU wheel; elsewhere use PyTorch's CPU index if you want to avoid the
# CUDA packages), then Flower 1.41, then the project with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
# flwr 1.42 needs a newer certifi than some registries carry; 1.41 works everywhere we run.
"$PY" -m pip install --quiet --disable-pip-version-check "flwr[simulation]==1.41.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
