#!/usr/bin/env bash
# The image pairs of the suite on a many-core machine with a GPU, two lanes side by side:
#  * CPU lane: every image pair's default learned alignment and each variant (default: refine-lambda 0.2,0.8),
#    each with refinement seeds 0, 1, 2, each child on one CPU thread (CUDA hidden), 12 at a time: the
#    spread over refinement seeds that a default is chosen on, in the time of two runs;
#  * GPU lane: the CUDA device tests, then what `fedbasin align A B --out C --refine-data SPEC` (no other
#    option) does on the GPU for the pairs in GPU_MEMBERS.
#
#   CACHE=runs/suite CIFAR=../shared/data/cifar10 OUT=dir bash scripts/device_image_suite.sh
#
# CACHE holds the trained pairs (the suite's digits/, cifar10-w64/, cifar10-w96/; missing ones are trained);
# MEMBERS, GPU_MEMBERS, VARIANTS (newline-separated NAME=OPTIONS), SEEDS (further refinement seeds), JOBS,
# LIMIT (seconds per lane), GPU_THREADS (CPU threads of the GPU lane, default 4), SUITE_ARGS (more suite
# options, both lanes) and GPU_ARGS (the GPU lane's own, e.g. --jobs 2) change the defaults; VARIANTS="" runs none; GPU_MEMBERS="" skips the GPU lane. Pairs missing from CACHE are
# trained by the CPU lane (train them first with the suite's --train-only when the GPU lane needs them too).
# Measured 2026-11-27 on an H200 machine: the CPU lane 381 s; the device tests beside 12 CPU jobs ran past
# their 120 s limit (alone: 24 s), hence the GPU lane's own thread count. Writes to $OUT: machine.txt, cpu.txt / cpu.json / cpu.log and gpu.txt / gpu.json /
# gpu.log (the suite's table, rows and progress per lane), device_tests.txt.
set -u
out=${OUT:-device-image-suite}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
python=${PYTHON:-python3}
cache=${CACHE:-runs/suite}
cifar=${CIFAR:-../shared/data/cifar10}
members=${MEMBERS:-digits-s01 digits-s23 cifar10-w64-s01 cifar10-w96-s01}
gpu_members=${GPU_MEMBERS-digits-s23 cifar10-w96-s01}
variants=${VARIANTS-"l28=--refine-lambda 0.2,0.8"}
limit=${LIMIT:-540}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  nproc
  $python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"; } \
    | tee "$out/machine.txt"
args=()
while IFS= read -r line; do [ -n "$line" ] && args+=(--variant "$line"); done <<<"$variants"
gpu_cache=$(mktemp -d)  # the GPU lane's own work folder (the lanes would share work/MEMBER otherwise)
trap 'rm -rf "$gpu_cache"' EXIT
for member in $gpu_members; do
    recipe=${member%-s*}
    [ -d "$cache/$recipe" ] && [ ! -e "$gpu_cache/$recipe" ] && cp -r "$cache/$recipe" "$gpu_cache/"
done
t0=$SECONDS
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 timeout "$limit" $python -m fedbasin.benchmarks.suite --members $members \
    --cache "$cache" --cifar "$cifar" --out "$out/cpu.json" "${args[@]}" --refine-seeds ${SEEDS:-1 2} \
    --jobs "${JOBS:-12}" ${SUITE_ARGS:-} >"$out/cpu.txt" 2>"$out/cpu.log" &
cpu=$!
if [ -n "$gpu_members" ]; then
    OMP_NUM_THREADS=${GPU_THREADS:-4} timeout 120 $python -m pytest -q -p no:cacheprovider tests/test_device.py -rA \
        --tb=short >"$out/device_tests.txt" 2>&1
    echo "device tests: exit $? in $((SECONDS - t0)) s" | tee -a "$out/machine.txt"
    left=$((limit - (SECONDS - t0)))
    [ "$left" -ge 1 ] || left=1
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=${GPU_THREADS:-4} timeout "$left" $python -m fedbasin.benchmarks.suite --members $gpu_members \
        --cache "$gpu_cache" --cifar "$cifar" --out "$out/gpu.json" ${SUITE_ARGS:-} ${GPU_ARGS:-} >"$out/gpu.txt" 2>"$out/gpu.log"
    echo "GPU lane: exit $? in $((SECONDS - t0)) s" | tee -a "$out/machine.txt"
fi
wait $cpu
echo "CPU lane: exit $? in $((SECONDS - t0)) s" | tee -a "$out/machine.txt"
cat "$out/cpu.txt" "$out/gpu.txt" 2>/dev/null
tail -n 3 "$out/cpu.log" "$out/gpu.log" 2>/dev/null
