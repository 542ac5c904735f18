#!/usr/bin/env bash
# One command from a fresh machine: install, then run the main job (a small federated simulation
# of a ViT on scikit-learn's bundled digits, offline) and write runs/demo/results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
exec fedbasin simulate --out "${1:-runs/demo}"
