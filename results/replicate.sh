#!/usr/bin/env bash
# Every command behind results/replication/ (see results/README.md). Resumable: a setting whose record exists is
# skipped, so run it again after any interruption; stages run in the order given, most important first.
#   bash results/replicate.sh [DATA_DIR] [RUNS_DIR] [STAGE ...]
# Stages (default: headline protocols budgets gemma summaries long_context tables):
#   zero_shot     the first replication: SmolLM2, 0-shot, 100 documents (MathQA 50); COPA's full cache is its anchor
#   headline      SmolLM2, 5-shot, simulate at 20 %: full, h2o, local, h2o_reference, streaming, tova
#   protocols     SmolLM2, 5-shot, prefill and context at 20 %: every policy with a cache
#   budgets       SmolLM2, 5-shot, simulate at 10 % and 50 %: h2o, local, h2o_reference, streaming, tova
#   gemma         Gemma 3 270M, 5-shot, the headline and prefill cells on fewer documents
#   summaries     XSUM and CNN/DM, 100 documents, prefill at 20 %: full, h2o, local, streaming, tova
#   long_context  niah_single and niah_multikey at 1k/2k/4k, every policy at 10 % and 25 %, prefill and context
#   tables        results/replication/5shot/ (paired against full, and against local) and the needle heatmaps
#
# zero_shot writes to RUNS_DIR and results/replication/ (as it did); the others to RUNS_DIR/5shot.
#
# Cost, measured (one thread, this 2-core CPU): 5-shot lm-eval requests average 206 tokens per document on COPA,
# 466 PIQA, 431 OpenBookQA, 292 Winogrande, 1,010 RTE and 1,707 MathQA (SmolLM2's tokenizer, choices counted).
# With the full cache SmolLM2 takes about 100 s for COPA's 100 documents and 240 s for PIQA's first 100; eviction
# adds 10-20 %; Gemma 3 270M is 3-5x slower (262k-word vocabulary). So one SmolLM2 cell over the limits below
# takes about 1,200 s, and the headline stage about 2 core-hours. Lower the limits to fit less time.
set -euo pipefail
data=${1:-../shared/data}
runs=${2:-results/runs}
shift $(( $# < 2 ? $# : 2 ))
stages=${*:-headline protocols budgets gemma summaries long_context tables}
# Two runners side by side, one thread each: on 2 cores, two processes of 2 threads each thrash (5x slower).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
sweep() { python -m h2o_eval --multirun data_dir="$data" results_dir="$out" wandb.mode=disabled threads=1 "$@"; }
out=$runs/5shot

# Per-task limits, paired into two runners of about equal cost (runner 1: COPA, RTE and MathQA; runner 2: the rest).
five_shot="+experiment=paper_5shot"
runner1_tasks() { sweep $five_shot task=copa "$@"; sweep $five_shot task=rte,mathqa limit=50 "$@"; }
runner2_tasks() { sweep $five_shot task=piqa,winogrande,openbookqa limit=100 "$@"; }
both() {  # the same settings on the six tasks, as two runners; fails if either does
    runner1_tasks "$@" >> "$runs.runner1.log" 2>&1 &
    local first=$!
    runner2_tasks "$@" >> "$runs.runner2.log" 2>&1 &
    local second=$! status=0
    wait $first || status=$?
    wait $second || status=$?
    [ $status -eq 0 ] || { echo "a sweep failed: see $runs.runner*.log, then run this again" >&2; exit $status; }
}

zero_shot() {
    local out=$runs ll5="task=copa,rte,openbookqa,winogrande,piqa limit=100" mathqa="task=mathqa limit=50"
    {
        sweep $ll5 policy=full,h2o,local budget=0.2
        sweep $mathqa policy=full,h2o,local budget=0.2
        sweep task=xsum,cnn_dailymail limit=50 num_fewshot=0 policy=full,h2o,local budget=0.2
        sweep $ll5 policy=h2o,local budget=0.05,0.1,0.5
        sweep $mathqa policy=h2o,local budget=0.05,0.1,0.5
    } >> "$runs.runner1.log" 2>&1 &
    local first=$!
    {
        sweep $ll5 policy=h2o_reference budget=0.05,0.1,0.2,0.5
        sweep $mathqa policy=h2o_reference budget=0.05,0.1,0.2,0.5
        sweep $ll5 policy=h2o,local budget=0.2 protocol=prefill
        sweep $mathqa policy=h2o,local budget=0.2 protocol=prefill
    } >> "$runs.runner2.log" 2>&1 &
    local second=$! status=0
    wait $first || status=$?
    wait $second || status=$?
    [ $status -eq 0 ] || { echo "a sweep failed: see $runs.runner*.log, then run this again" >&2; exit $status; }
    python -m h2o_eval.plot "$runs" --out results/replication --at 0.2
    python -m h2o_eval.analyze --model smollm2-135m --task piqa --num-fewshot 5 --limit 30 --data-dir "$data" \
        --out results/replication/observations
}

headline() { both model=smollm2-135m policy=full,h2o,local,h2o_reference,streaming,tova budget=0.2; }
protocols() {
    both model=smollm2-135m policy=h2o,local,streaming,tova,snapkv,pyramidkv,adakv,knorm budget=0.2 \
        protocol=prefill,context
}
budgets() { both model=smollm2-135m policy=h2o,local,h2o_reference,streaming,tova budget=0.1,0.5; }
gemma() {
    sweep model=gemma3-270m $five_shot task=copa policy=full,h2o,local,streaming,tova budget=0.2 \
        >> "$runs.runner1.log" 2>&1 &
    local first=$!
    sweep model=gemma3-270m $five_shot task=piqa limit=200 policy=full,h2o,local,streaming budget=0.2 \
        protocol=simulate,prefill >> "$runs.runner2.log" 2>&1 &
    local second=$! status=0
    wait $first || status=$?
    wait $second || status=$?
    [ $status -eq 0 ] || { echo "a sweep failed: see $runs.runner*.log, then run this again" >&2; exit $status; }
}
summaries() {  # 0-shot: the paper's 5-shot HELM prompts are about 2,600 tokens, 44 s per document here
    local settings="model=smollm2-135m limit=100 num_fewshot=0 protocol=prefill policy=full,h2o,local,streaming,tova"
    sweep $settings budget=0.2 task=xsum >> "$runs.runner1.log" 2>&1 &
    local first=$!
    sweep $settings budget=0.2 task=cnn_dailymail >> "$runs.runner2.log" 2>&1 &
    local second=$! status=0
    wait $first || status=$?
    wait $second || status=$?
    [ $status -eq 0 ] || { echo "a sweep failed: see $runs.runner*.log, then run this again" >&2; exit $status; }
}
long_context() {
    # batch_size=4: a 4k grid holds every cell's cache for each document of a batch, 6.8 GB at 4 documents and
    # 15.7 GB at 10 (measured peak RSS), so two grids side by side fit 24 GB only at 4.
    local grid="python -m h2o_eval.grid model=smollm2-135m task.length=1024,2048,4096 ++task.max_new_tokens=32
        limit=20 batch_size=4 policy=full,h2o,local,streaming,tova,snapkv,pyramidkv,adakv,knorm budget=0.1,0.25
        protocol=prefill,context threads=1 data_dir=$data results_dir=$out wandb.mode=disabled"
    $grid task=niah_single >> "$runs.runner1.log" 2>&1 &
    local first=$!
    $grid task=niah_multikey >> "$runs.runner2.log" 2>&1 &
    local second=$! status=0
    wait $first || status=$?
    wait $second || status=$?
    [ $status -eq 0 ] || { echo "a grid failed: see $runs.runner*.log, then run this again" >&2; exit $status; }
}
tables() {
    python -m h2o_eval.plot "$out" --out results/replication/5shot --at 0.1 0.2 0.5
    python -m h2o_eval.plot "$out" --out results/replication/5shot/against_local --at 0.2 --against local
    python -m h2o_eval.plot "$out" --needle --out results/replication/long_context
}

mkdir -p "$out"
for stage in $stages; do
    case $stage in
        zero_shot | headline | protocols | budgets | gemma | summaries | long_context | tables)
            echo "$(date -u +%H:%M:%S) $stage"
            $stage
            ;;
        *) echo "unknown stage '$stage': use zero_shot, headline, protocols, budgets, gemma, summaries, long_context or tables" >&2; exit 2 ;;
    esac
done
