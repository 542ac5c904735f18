#!/usr/bin/env bash
# The GPT-2 recipe pair on a GPU (docs/journal/merging-notes.md §13): does learned refinement reach the ≤ 0.02 barrier
# when compute is not the limit? Trains the pair there (gpt2_pair --device cuda, both seeds side by side),
# measures vanilla and data-free rows, then runs `fedbasin align --refine-data` at the 2-core CPU setting
# (docs/journal/merging-notes.md §12) and at 16 times its training examples (plain and dual), 8 times with the full
# softmax, and 24 times on request (RUNS); each endpoint's barrier is measured on the first 32 test blocks and on the 141 validation
# blocks right after its run.
#
#   TEXT=.../tinyshakespeare/input.txt TOKENIZER=.../gpt2_tokenizer OUT=dir bash scripts/gpu_gpt2_learned.sh
#
# PAIR=DIR reuses a trained pair (DIR/seed0, DIR/seed1) instead of training one; DEVICE (default cuda);
# RUNS: the rows to run (default "datafree cpu_setting x16 x16_dual x8_full_vocab"; also x24, x64 and x64_dual
# (1,600 steps of 64 blocks, one-sided / dual) and x128_dual (3,200 steps of 64 blocks, dual); x64_dual_head: x64_dual with the
# per-head maps at 8 times the lr (--refine-head-lr 0.024));
# STEP_DIVISOR=N divides every step count (a quick dry run of the pipeline); BUDGET (s, default 560): a
# step that would not finish inside it is skipped and says so. Writes summary.txt (every step's output),
# rows.jsonl (one line per barrier row) and align.log (the runs' progress) to $OUT.
set -u
out=${OUT:-gpu-gpt2}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
T=${TEXT:-../shared/data/tinyshakespeare/input.txt}
TOK=${TOKENIZER:-../shared/data/gpt2_tokenizer}
device=${DEVICE:-cuda}
div=${STEP_DIVISOR:-1}
budget=${BUDGET:-560}
work=$(mktemp -d)
R=${PAIR:-$work/pair}
summary=$out/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
say "work folder (the pair, for PAIR= in a later call): $work"

step() {  # step NAME SECONDS COMMAND...: run with a time limit inside the budget, output to the summary
    local name=$1 limit=$2; shift 2
    local left=$((budget - SECONDS)) t0=$SECONDS code
    if [ "$left" -lt 20 ]; then say "== $name: skipped, ${left} s of the budget left"; return 1; fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" >"$work/$name.out" 2>"$work/$name.err"
    code=$?
    say "== $name: exit $code in $((SECONDS - t0)) s (limit $limit s)"
    tail -n 30 "$work/$name.out" | tee -a "$summary"
    [ $code -eq 0 ] || tail -c 1500 "$work/$name.err" | tee -a "$summary"
    return $code
}

barriers() {  # barriers NAME [glmc_compare options...]: rows on the first 32 test blocks and on validation
    local name=$1 split; shift
    for split in test validation; do
        local blocks=""; [ $split = test ] && blocks="--max-blocks 32"
        step "eval_${name}_$split" 120 $python -m fedbasin.benchmarks.glmc_compare "$R/seed0" "$R/seed1" --text "$T" \
            --points 11 $blocks --split $split --circuit-variant "" --glmc-rows "" --device "$device" \
            --out "$work/$name.$split.json" "$@" &&
        $python -c "import json, sys; r = json.load(open(sys.argv[1])); [print(json.dumps({'run': sys.argv[2], 'split': r['split'], \
'blocks': r['test_blocks'], 'row': k, 'barrier': round(v['barrier'], 4), 'losses': [round(x, 4) for x in v['losses']], \
'machine': r['machine']})) for k, v in r['rows'].items()]" "$work/$name.$split.json" "$name" >>"$out/rows.jsonl"
    done
}

learned() {  # learned NAME SECONDS STEPS BATCH [align options...]: one refined endpoint and its barriers
    local name=$1 limit=$2 steps=$(($3 / div)) batch=$4; shift 4
    local vocabulary=(--refine-vocabulary seen --refine-vocabulary-samples 2048)  # unless the options name their own
    case " $* " in *" --refine-vocabulary "*) vocabulary=() ;; esac  # (an option given twice is refused)
    step "align_$name" "$limit" $python -m fedbasin align "$R/seed0" "$R/seed1" --out "$work/$name" \
        --device "$device" --seen-tokens "text:$T" --refine-data "text:$T" --refine-group invertible \
        --refine-lambda 0.2 0.6 --refine-permutations fixed --refine-lr 0.003 --refine-schedule cosine \
        "${vocabulary[@]}" --head-weight 2 --refine-examples 2048 \
        --refine-steps "$steps" --refine-batch-size "$batch" --refine-eval-every $(( steps / 2 > 0 ? steps / 2 : 1 )) "$@"
    local code=$?
    cat "$work/align_$name.err" >>"$out/align.log"
    [ $code -eq 0 ] || return $code
    say "$name: $steps steps x batch $batch"
    barriers "$name" --skip-vanilla --variants "" --aligned "$name=$work/$name"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$summary"
$python -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cpus', torch.get_num_threads())" | tee -a "$summary"
if [ ! -f "$R/seed1/config.json" ]; then
    for seed in 0 1; do  # side by side on one device
        $python -m fedbasin.benchmarks.gpt2_pair --seed $seed --epochs "${EPOCHS:-6}" --device "$device" --out "$R" \
            --text "$T" --tokenizer "$TOK" --threads 4 >"$work/train$seed.out" 2>"$work/train$seed.err" &
    done
    wait
    cat "$work"/train?.out | tee -a "$summary"
    [ -f "$R/seed1/config.json" ] || { tail -c 1500 "$work"/train?.err | tee -a "$summary"; exit 1; }
    say "== train: done at $SECONDS s"
fi
wanted() { [[ " ${RUNS:-datafree cpu_setting x16 x16_dual x8_full_vocab} " == *" $1 "* ]]; }
wanted datafree && barriers datafree --variants orthogonal/rms/sqrt/2,permutation/rms/sqrt/2
wanted cpu_setting && learned cpu_setting 120 200 8
wanted x16 && learned x16 200 1600 16
wanted x16_dual && learned x16_dual 200 1600 16 --refine-dual
wanted x8_full_vocab && learned x8_full_vocab 200 800 16 --refine-vocabulary full --refine-vocabulary-samples 0
wanted x24 && learned x24 200 2400 16
wanted x64 && learned x64 200 1600 64
wanted x64_dual && learned x64_dual 300 1600 64 --refine-dual
wanted x128_dual && learned x128_dual 300 3200 64 --refine-dual
wanted x64_dual_head && learned x64_dual_head 170 1600 64 --refine-dual --refine-head-lr 0.024
say "== done at $SECONDS s"
