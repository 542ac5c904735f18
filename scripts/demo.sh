#!/usr/bin/env bash
# One command from a fresh machine: install, then run the main job (a small federated simulation
# of a ViT on scikit-learn's bundled digits, offline) and write runs/demo/results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
if [ $# -eq 0 ]; then
    # the demo's own default directory is replaced on a rerun; a directory you name is never overwritten
    exec fedbasin simulate --out runs/demo --overwrite
fi
exec fedbasin simulate --out "$1"
