#!/usr/bin/env bash
# The defaults on a GPU: what `fedbasin align A B --out C --refine-data text:TEXT` (no other option) does
# on CUDA within its default 120 s budget, beside candidate GPU settings measured the same way
# (the suite's --variant rows). The suite's members (default gpt2-s01) are trained there
# (--train-device cuda: a pair of the documented recipe, not the CPU's bit-identical pair) and
# measured through the command line as on the CPU (docs/benchmarks.md, "The suite").
#
#   TEXT=../shared/data/tinyshakespeare/input.txt TOKENIZER=../shared/data/gpt2_tokenizer OUT=dir \
#       bash scripts/gpu_defaults.sh
#
# MEMBERS: suite members (default gpt2-s01); VARIANTS: newline-separated NAME=OPTIONS (default: batch 64,
# and batch 64 with --refine-dual); LIMIT: seconds for the whole suite run (default 540); SUITE_ARGS: more
# suite options (a dry run on a CPU: MEMBERS=digits-s01 SUITE_ARGS=--skip-learned VARIANTS="q=--refine-budget 5").
# Writes to $OUT: gpu.txt (the machine), suite.txt (the tables), suite.json (rows), suite.log
# (progress), logs.tar.gz (every child command's log).
set -u
out=${OUT:-gpu-defaults}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
cache=${CACHE:-$(mktemp -d)}
variants=${VARIANTS:-"b64=--refine-batch-size 64
b64dual=--refine-batch-size 64 --refine-dual"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$python -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cpus', torch.get_num_threads())" | tee -a "$out/gpu.txt"
args=()
while IFS= read -r line; do [ -n "$line" ] && args+=(--variant "$line"); done <<<"$variants"
t0=$SECONDS
# shellcheck disable=SC2086
timeout "${LIMIT:-540}" $python -m fedbasin.benchmarks.suite --members ${MEMBERS:-gpt2-s01} --cache "$cache" \
    --out "$out/suite.json" --text "${TEXT:-../shared/data/tinyshakespeare/input.txt}" \
    --tokenizer "${TOKENIZER:-../shared/data/gpt2_tokenizer}" --train-device cuda "${args[@]}" ${SUITE_ARGS:-} \
    >"$out/suite.txt" 2>"$out/suite.log"
code=$?
echo "suite: exit $code in $((SECONDS - t0)) s" | tee -a "$out/gpu.txt"
cat "$out/suite.txt"
tail -n 5 "$out/suite.log"
(cd "$cache" && find . -name '*.log' -o -name train.json | tar czf "$out/logs.tar.gz" -T -)
exit $code
