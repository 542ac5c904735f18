#!/usr/bin/env bash
# The CUDA checks (docs/scale.md, "On a GPU"): the device tests with CUDA cases enabled, GPT-2-small's
# shape aligned on the GPU and on the same machine's CPU, and the 1.1 B Llama-shaped pair streamed through the GPU.
# Needs an NVIDIA GPU, PyTorch with CUDA and this project's dependencies; writes its logs to $OUT
# (default ./gpu-check). Each step has its own time limit, so one slow step cannot hide the others.
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$python -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cpus', torch.get_num_threads())" | tee -a "$out/gpu.txt"
errors=$(mktemp -d)  # progress bars and logs: shown only for a step that failed
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, stdout to $out/NAME.txt, say how it ended
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS code
    timeout "$limit" "$@" >"$out/$name.txt" 2>"$errors/$name.err"
    code=$?
    echo "== $name: exit $code in $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.txt"
    [ $code -eq 0 ] || tail -c 2000 "$errors/$name.err"
}
step device_tests 180 $python -m pytest -q -p no:cacheprovider tests/test_device.py -rA --tb=short --durations=8
step speed_cuda 90 $python -m fedbasin.benchmarks.bench_speed --device cuda
step speed_cpu 90 $python -m fedbasin.benchmarks.bench_speed --device cpu  # the same machine's CPU, every core
step memory_cuda 120 $python -m fedbasin.benchmarks.bench_memory --device cuda --threads 8 --dir /tmp/fedbasin-mem
